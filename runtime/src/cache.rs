//! A map bounded in bytes, for the preprocessed screenshots and the vision-tower outputs.
//!
//! Key choice: when an insert would go over the budget the map starts again empty. Screens of a session
//! repeat back to back, so recency matters more than a careful eviction order, and a clear is cheap.

use std::collections::HashMap;

/// Bytes of preprocessed screenshots, and of vision features, kept by content hash (each cache).
const CACHE_BYTES: usize = 256 << 20;

/// A map bounded in bytes: when an insert would go over the budget it starts again empty (screens of a
/// session repeat back to back, so recency matters more than a careful eviction order).
pub(crate) struct ByteCache<K, V> {
    map: HashMap<K, V>,
    bytes: usize,
}

impl<K: std::hash::Hash + Eq, V: Clone> ByteCache<K, V> {
    pub(crate) fn new() -> Self {
        Self { map: HashMap::new(), bytes: 0 }
    }

    pub(crate) fn get(&self, k: &K) -> Option<V> {
        self.map.get(k).cloned()
    }

    pub(crate) fn insert(&mut self, k: K, v: V, bytes: usize) {
        if self.bytes + bytes > CACHE_BYTES {
            self.map.clear();
            self.bytes = 0;
        }
        if bytes <= CACHE_BYTES {
            self.map.insert(k, v);
            self.bytes += bytes;
        }
    }
}
