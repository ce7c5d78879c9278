//! Reuse of computed prompt prefixes: the KV caches of recent prompts, so that a prompt sharing a
//! beginning with one of them prefills only the rest.
//!
//! The common case is a session: the step after an `ask` is the previous prompt (system, task, history,
//! screenshot) plus the question and the user's answer, so everything up to the answer, screenshot
//! included, is already computed. Repeated requests (a client retrying, a benchmark) hit it too. Entries
//! are keyed by the prompt's tokens where each image token carries its image's content hash, so two
//! prompts share a prefix only where they share the same images; keys are per adapter (an adapter changes
//! every key and value). The cache is bounded in bytes, oldest entries leave first, and an entry that is a
//! prefix of a newer one is replaced by it.

use std::collections::VecDeque;

use askgui_model::KvCache;

/// Marks image positions in a key, so they never equal a token id (the hash keeps all its 64 bits).
const IMAGE_BIT: u128 = 1 << 64;

/// A prompt as a cache key: token ids, and at image tokens the image's hash with a bit above it set.
/// `image_hashes` are the prompt's images in order; each run of `image_token` is one image.
pub fn prompt_key(ids: &[u32], image_token: u32, image_hashes: &[u64]) -> Vec<u128> {
    let mut images = image_hashes.iter();
    let mut current = 0;
    let mut key = Vec::with_capacity(ids.len());
    for (i, &id) in ids.iter().enumerate() {
        if id == image_token {
            if i == 0 || ids[i - 1] != image_token {
                current = images.next().copied().unwrap_or(0);
            }
            key.push(IMAGE_BIT | current as u128);
        } else {
            key.push(id as u128);
        }
    }
    key
}

/// How much of `key` a cache of its first `len` positions may stand for: `len`, moved back to the start
/// of an image when it falls inside one (an image's features are computed whole), and kept below
/// `key.len()` (the last position must be run for its logits).
fn usable(key: &[u128], mut len: usize) -> usize {
    len = len.min(key.len().saturating_sub(1));
    while len > 0 && len < key.len() && key[len] & IMAGE_BIT != 0 && key[len] == key[len - 1] {
        len -= 1;
    }
    len
}

/// How many images begin in `key[..len]`.
pub fn images_before(key: &[u128], len: usize) -> usize {
    (0..len).filter(|&i| key[i] & IMAGE_BIT != 0 && (i == 0 || key[i - 1] != key[i])).count()
}

struct Entry {
    adapter: Option<String>,
    key: Vec<u128>,
    cache: KvCache,
    bytes: usize,
}

/// Recent prompts' KV caches, bounded in bytes.
pub struct PrefixCache {
    entries: VecDeque<Entry>,
    bytes: usize,
    budget: usize,
}

impl PrefixCache {
    /// A cache holding at most `budget` bytes of keys and values (0 turns it off).
    pub fn new(budget: usize) -> Self {
        Self { entries: VecDeque::new(), bytes: 0, budget }
    }

    /// The longest usable prefix of `key` that an entry holds, as `(length, cache of that length)`.
    pub fn lookup(&mut self, adapter: Option<&str>, key: &[u128]) -> Option<(usize, KvCache)> {
        let (best, len) = self
            .entries
            .iter()
            .enumerate()
            .filter(|(_, e)| e.adapter.as_deref() == adapter)
            .map(|(i, e)| (i, usable(key, e.key.iter().zip(key).take_while(|(a, b)| a == b).count())))
            .max_by_key(|&(_, len)| len)?;
        if len == 0 {
            return None;
        }
        let entry = self.entries.remove(best)?;
        let cache = entry.cache.truncated(len).ok()?;
        self.entries.push_back(entry);
        Some((len, cache))
    }

    /// Drops the oldest entry (its blocks go back to the pool unless a sequence still shares them);
    /// false when there was none.
    pub fn evict_oldest(&mut self) -> bool {
        let Some(old) = self.entries.pop_front() else { return false };
        self.bytes -= old.bytes;
        true
    }

    /// Keeps `cache`, the keys and values of exactly the prompt `key`.
    pub fn insert(&mut self, adapter: Option<&str>, key: Vec<u128>, cache: KvCache) {
        let bytes = cache.bytes() + key.len() * 16;
        if bytes > self.budget {
            return;
        }
        // An entry the new one extends (or repeats) is of no further use.
        let before = self.entries.len();
        self.entries.retain(|e| !(e.adapter.as_deref() == adapter && key.starts_with(&e.key)));
        if self.entries.len() != before {
            self.bytes = self.entries.iter().map(|e| e.bytes).sum();
        }
        while self.bytes + bytes > self.budget {
            let Some(old) = self.entries.pop_front() else { break };
            self.bytes -= old.bytes;
        }
        self.bytes += bytes;
        self.entries.push_back(Entry { adapter: adapter.map(String::from), key, cache, bytes });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const IMG: u32 = 9;

    #[test]
    fn keys_tell_images_apart() {
        let a = prompt_key(&[1, IMG, IMG, 2, IMG], IMG, &[10, 20]);
        let b = prompt_key(&[1, IMG, IMG, 2, IMG], IMG, &[10, 11]);
        assert_eq!(a[..4], b[..4]);
        assert_ne!(a[4], b[4], "a second image whose hash differs in one bit");
        assert_eq!(a[1], a[2], "one image's tokens share a key");
        assert_ne!(a[0], a[1]);
        assert_eq!(images_before(&a, 4), 1);
        assert_eq!(images_before(&a, 5), 2);
    }

    #[test]
    fn a_prefix_never_ends_inside_an_image_or_at_the_last_token() {
        let k = prompt_key(&[1, 2, IMG, IMG, IMG, 3], IMG, &[7]);
        assert_eq!(usable(&k, 3), 2, "inside the image: back to its start");
        assert_eq!(usable(&k, 5), 5, "right after the image");
        assert_eq!(usable(&k, 6), 5, "the last token is always run");
        assert_eq!(usable(&k, 0), 0);
    }
}
