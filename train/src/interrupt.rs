//! Ctrl-C and SIGTERM end a training run without losing work: the first finishes the optimiser step in
//! flight, writes a checkpoint and stops the run (the binary then exits non-zero with the resume command);
//! a second exits at once.
//!
//! Key choice: the handler only swaps an atomic flag (async-signal-safe) and writes one fixed line with
//! `write(2)`; the training loop polls the flag between optimiser steps ([`crate::config::RunControl`]).

use std::sync::atomic::{AtomicBool, Ordering};

static INTERRUPTED: AtomicBool = AtomicBool::new(false);

const NOTICE: &[u8] =
    b"\ninterrupted: finishing this optimiser step and writing a checkpoint (interrupt again to exit at once)\n";

extern "C" fn on_signal(_: libc::c_int) {
    if INTERRUPTED.swap(true, Ordering::SeqCst) {
        // SAFETY: `_exit` is async-signal-safe; a second interrupt means "now".
        unsafe { libc::_exit(130) };
    }
    // SAFETY: `write` is async-signal-safe and NOTICE is a static buffer.
    unsafe { libc::write(2, NOTICE.as_ptr().cast(), NOTICE.len()) };
}

/// Whether an interrupt has arrived since [`install`].
pub fn requested() -> bool {
    INTERRUPTED.load(Ordering::SeqCst)
}

/// Installs the handler for SIGINT and SIGTERM; returns the flag it sets.
pub fn install() -> &'static AtomicBool {
    let handler = on_signal as extern "C" fn(libc::c_int) as libc::sighandler_t;
    // SAFETY: the handler only touches an atomic and calls async-signal-safe functions.
    unsafe {
        libc::signal(libc::SIGINT, handler);
        libc::signal(libc::SIGTERM, handler);
    }
    &INTERRUPTED
}
