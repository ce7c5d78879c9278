//! Launch plan (to be written).
