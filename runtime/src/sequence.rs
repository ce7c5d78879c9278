//! One sequence being decoded: its KV cache, its next M-RoPE position and the logits for its next token.
//!
//! Key choice: its model work goes through a [`Forward`] (the server's packs it with other jobs').
//! A prompt prefills only what follows its longest cached prefix ([`crate::prefix_cache`]), and options
//! are scored on copies of the cache, so scoring never changes the sequence. The answer after the prompt
//! can be brought to any token sequence ([`Seq::sync`]): the KV cache is cut back to the longest common
//! prefix and the rest is fed, which is how constrained decoding keeps the answer in the tokenisation the
//! model was trained on.

use askgui_model::mrope_positions;
use askgui_model::KvCache;

use crate::error::{Result, RuntimeError};
use crate::forward::Forward;
use crate::packed::{Item, ItemOut};
use crate::prefix_cache::{images_before, prompt_key};
use crate::prompt::PreparedImage;
use crate::runtime::Runtime;
use crate::sampling::log_softmax_at;

/// One sequence being decoded: its KV cache, the next M-RoPE position and the logits for the next token.
/// Its model work goes through a [`Forward`].
pub(crate) struct Seq<'f> {
    fwd: &'f dyn Forward,
    cache: KvCache,
    next: u32,
    pub(crate) logits: Vec<f32>,
    /// The tokens fed after the prompt, in the cache.
    answer: Vec<u32>,
    /// The cache length, next position and logits right after the prompt.
    prompt: (usize, u32, Vec<f32>),
}

impl<'f> Seq<'f> {
    /// Prefills the prompt `ids` with its `images`, starting from the longest cached prefix; returns the
    /// sequence and how many prompt tokens came from the cache.
    pub(crate) fn prefill(
        rt: &Runtime,
        fwd: &'f dyn Forward,
        ids: &[u32],
        images: &[PreparedImage],
    ) -> Result<(Self, usize)> {
        let grids: Vec<[usize; 3]> = images.iter().map(|(_, i)| i.grid_thw).collect();
        let (pos, next) = mrope_positions(ids, &grids, &rt.cfg)?;
        let hashes: Vec<u64> = images.iter().map(|(h, _)| *h).collect();
        let key = prompt_key(ids, rt.cfg.image_token_id, &hashes);
        let adapter = fwd.adapter();
        let found = rt.prefixes.lock().unwrap_or_else(|p| p.into_inner()).lookup(adapter, &key);
        let (start, cache) = found.unwrap_or_else(|| (0, KvCache::in_pool(rt.kv_pool.clone())));
        let _room = rt.admit(ids.len() - start)?;
        let item = Item {
            ids: ids[start..].to_vec(),
            positions: pos[start..].to_vec(),
            images: images[images_before(&key, start)..].to_vec(),
            cache,
            logits_rows: 1,
            forks: vec![],
            adapter: adapter.map(String::from),
        };
        let ItemOut { cache, mut logits } = one(fwd.run(vec![item])?)?;
        rt.prefixes.lock().unwrap_or_else(|p| p.into_inner()).insert(adapter, key, cache.clone());
        let logits = logits.pop().unwrap_or_default();
        let prompt = (ids.len(), next, logits.clone());
        Ok((Self { fwd, cache, next, logits, answer: Vec::new(), prompt }, start))
    }

    /// An item running `tokens` after this sequence (on a copy of its cache), with logits for its last
    /// `logits_rows` rows: a continuation when `forks` is empty, else forks of these lengths.
    fn item(&self, tokens: Vec<u32>, logits_rows: usize, forks: Vec<usize>) -> Item {
        let whole = [tokens.len()];
        let runs = if forks.is_empty() { &whole[..] } else { &forks[..] };
        Item {
            positions: runs.iter().flat_map(|&n| (0..n as u32).map(|i| [self.next + i; 3])).collect(),
            ids: tokens,
            images: vec![],
            cache: self.cache.clone(),
            logits_rows,
            forks,
            adapter: self.fwd.adapter().map(String::from),
        }
    }

    /// Appends `tokens` to the sequence.
    pub(crate) fn feed(&mut self, tokens: &[u32]) -> Result<()> {
        if tokens.is_empty() {
            return Ok(());
        }
        let ItemOut { cache, mut logits } = one(self.fwd.run(vec![self.item(tokens.to_vec(), 1, vec![])])?)?;
        self.cache = cache;
        self.next += tokens.len() as u32;
        self.logits = logits.pop().unwrap_or_default();
        self.answer.extend_from_slice(tokens);
        Ok(())
    }

    /// Brings the answer after the prompt to exactly `target`: the cache is cut back to the longest
    /// common prefix (one token further when nothing follows, so that the logits are those after
    /// `target`), and the rest of `target` is fed.
    pub(crate) fn sync(&mut self, target: &[u32]) -> Result<()> {
        let mut keep = self.answer.iter().zip(target).take_while(|(a, b)| a == b).count();
        if keep == self.answer.len() {
            return self.feed(&target[keep..]);
        }
        if keep == target.len() && keep > 0 {
            keep -= 1;
        }
        let (prompt_len, prompt_next, prompt_logits) = &self.prompt;
        self.cache = self.cache.truncated(prompt_len + keep)?;
        self.answer.truncate(keep);
        self.next = prompt_next + keep as u32;
        if keep == 0 {
            self.logits = prompt_logits.clone();
        }
        self.feed(&target[keep..])
    }

    /// `log p(option | sequence)` for each option, without changing the sequence: the options of more
    /// than one token run as forks of the cache in one item ([`Item::forks`]).
    pub(crate) fn logprobs(&self, options: &[Vec<u32>]) -> Result<Vec<f64>> {
        // Logits after each of option[..n-1] score option[1..].
        let heads: Vec<&[u32]> = options.iter().filter(|o| o.len() > 1).map(|o| &o[..o.len() - 1]).collect();
        let mut rows = Vec::new().into_iter();
        if !heads.is_empty() {
            let (ids, forks): (Vec<u32>, Vec<usize>) = (heads.concat(), heads.iter().map(|h| h.len()).collect());
            let n = ids.len();
            rows = one(self.fwd.run(vec![self.item(ids, n, forks)])?)?.logits.into_iter();
        }
        let mut total = Vec::with_capacity(options.len());
        for o in options {
            let Some((&first, rest)) = o.split_first() else {
                total.push(0.0);
                continue;
            };
            let mut l = log_softmax_at(&self.logits, first);
            for &tok in rest {
                let row = rows.next().ok_or_else(|| RuntimeError::Internal("a scoring row went missing".into()))?;
                l += log_softmax_at(&row, tok);
            }
            total.push(l);
        }
        Ok(total)
    }
}

/// The single answer of a one-item request.
fn one(mut outs: Vec<ItemOut>) -> Result<ItemOut> {
    match (outs.pop(), outs.is_empty()) {
        (Some(out), true) => Ok(out),
        _ => Err(RuntimeError::Internal("a forward answered the wrong number of items".into())),
    }
}
