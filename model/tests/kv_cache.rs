//! The block KV cache: packed decode steps over caches that fork, share a prefix and go on after another
//! sequence left give the logits of a full forward of each sequence's tokens; the pool's block count is
//! the blocks alive (shared ones once), returns to zero when every cache is gone (a panicking holder
//! included), and a full pool refuses with `KvCacheFull`. Forks of one cache scored in one step give the
//! logits of full forwards and leave the cache as it was.
//!
//! Tolerance for the logits: 1e-6 of the largest logit. The decode steps attend through
//! `paged_attention` (f64 sums over the blocks in place) and the full forward through the GEMM attention
//! over one concatenated prompt; both then run the same GEMMs on different row counts, so they differ by
//! float reassociation only. A wrong block, a key attended twice or a lost append moves logits by 1e-2 or
//! more.

mod common;

use askgui_model::model::positions_tensor;
use askgui_model::{KernelChoice, KvCache, KvPool, ModelError, NewRows, Qwen2Vl, KV_BLOCK};
use candle_core::{DType, Device, Tensor};
use common::*;

fn model() -> Qwen2Vl {
    Qwen2Vl::load(fixtures().join("tiny-qwen2_5_vl").to_str().unwrap(), &Device::Cpu, DType::F32).unwrap()
}

fn ids(seed: u32, n: usize) -> Vec<u32> {
    (0..n as u32).map(|i| (seed * 7919 + i * 104_729) % 200 + 1).collect()
}

fn embed(m: &Qwen2Vl, ids: &[u32]) -> Tensor {
    m.embed(&Tensor::from_slice(ids, (1, ids.len()), &Device::Cpu).unwrap(), None).unwrap()
}

/// Logits `(T, V)` of `ids` from one forward on a fresh cache.
fn full_logits(m: &Qwen2Vl, ids: &[u32]) -> Tensor {
    let n = ids.len();
    let pos = positions_tensor(&[(0..n).map(|p| [p as u32; 3]).collect()], n).unwrap();
    let hidden = m.decode(&embed(m, ids), &pos, None, &mut m.new_cache()).unwrap();
    m.logits(&hidden.squeeze(0).unwrap()).unwrap()
}

/// One packed step: sequence `s` feeds `news[s]` after its cache; returns each sequence's logits rows.
fn step(m: &Qwen2Vl, caches: &mut [&mut KvCache], news: &[&[u32]]) -> Vec<Tensor> {
    let rows: Vec<u32> = news.concat();
    let pos: Vec<[u32; 3]> =
        caches.iter().zip(news).flat_map(|(c, n)| (c.len()..c.len() + n.len()).map(|p| [p as u32; 3])).collect();
    let lens: Vec<usize> = news.iter().map(|n| n.len()).collect();
    let appended: Vec<NewRows> = lens.iter().map(|&n| NewRows::Append(n)).collect();
    let hidden = m.decode_packed(&embed(m, &rows), &positions_tensor(&[pos], rows.len()).unwrap(), &appended, caches);
    let logits = m.logits(&hidden.unwrap().squeeze(0).unwrap()).unwrap();
    let mut out = Vec::new();
    let mut at = 0;
    for n in lens {
        out.push(logits.narrow(0, at, n).unwrap());
        at += n;
    }
    out
}

fn close(what: &str, got: &Tensor, want: &Tensor) {
    let (max, _, scale) = diff(got, want);
    assert!(max <= 1e-6 * scale.max(1.0), "{what}: max |diff| {max:e} > 1e-6 x {scale:e}");
}

#[test]
fn forks_and_shared_prefixes_decode_as_full_forwards() {
    forks_and_shared_prefixes(KvCache::in_pool);
}

/// The same with one block per layer (the layout of batched CUDA caches and of devices without the paged
/// attention).
#[test]
fn whole_layer_caches_decode_as_full_forwards() {
    forks_and_shared_prefixes(KvCache::whole_in_pool);
}

/// The same with a prefill's positions as one block (the layout of CUDA caches): A's 100 positions are one
/// block, B's prefix a 70-position view of it.
#[test]
fn unsplit_prefill_caches_decode_as_full_forwards() {
    forks_and_shared_prefixes(KvCache::unsplit_in_pool);
}

fn forks_and_shared_prefixes(new_cache: fn(std::sync::Arc<KvPool>) -> KvCache) {
    let m = model();
    let pool = KvPool::new(0);
    // A: a 100-token prompt (three full blocks and four positions).
    let a_ids = ids(1, 100);
    let mut a = new_cache(pool.clone());
    step(&m, &mut [&mut a], &[&a_ids]);
    // B: A's first 70 positions (a block cut in two), going on its own way; C: all of A, shared.
    let mut b = a.truncated(70).unwrap();
    let mut c = a.clone();
    let mut b_ids = a_ids[..70].to_vec();
    let mut c_ids = a_ids.clone();
    let mut a_ids = a_ids;
    // One round with all three (B feeds 3 tokens), then A leaves and B and C go on past block boundaries.
    let (a_new, b_new, c_new) = ([7u32], [11u32, 12, 13], [17u32]);
    let outs = step(&m, &mut [&mut a, &mut b, &mut c], &[&a_new, &b_new, &c_new]);
    for (name, seq, new, out) in [
        ("A", &mut a_ids, &a_new[..], &outs[0]),
        ("B", &mut b_ids, &b_new[..], &outs[1]),
        ("C", &mut c_ids, &c_new[..], &outs[2]),
    ] {
        seq.extend_from_slice(new);
        let n = new.len();
        close(
            &format!("{name} after the first round"),
            out,
            &full_logits(&m, seq).narrow(0, seq.len() - n, n).unwrap(),
        );
    }
    drop(a);
    for round in 0..2 * KV_BLOCK {
        let (bt, ct) = (100 + round as u32 % 50, 150 + round as u32 % 40);
        let outs = step(&m, &mut [&mut b, &mut c], &[&[bt], &[ct]]);
        b_ids.push(bt);
        c_ids.push(ct);
        if round % 16 == 15 {
            close(
                &format!("B at {}", b_ids.len()),
                &outs[0],
                &full_logits(&m, &b_ids).narrow(0, b_ids.len() - 1, 1).unwrap(),
            );
            close(
                &format!("C at {}", c_ids.len()),
                &outs[1],
                &full_logits(&m, &c_ids).narrow(0, c_ids.len() - 1, 1).unwrap(),
            );
        }
    }
    assert_eq!((b.len(), c.len()), (b_ids.len(), c_ids.len()));
    drop((b, c));
    assert_eq!(pool.blocks_in_use(), 0, "every block goes back when its last cache is dropped");
}

/// Forks of one cache in one packed step (`NewRows::Forks`, beside a sequence that appends): each fork's
/// rows give the logits of a full forward of the prompt and that fork alone, and the cache is left as it
/// was. With askgui's kernels (`paged_attention_forks`) and the reference ones (each fork through the
/// plain attention), on every cache layout.
#[test]
fn forks_score_as_full_forwards_and_leave_the_cache_alone() {
    for kernels in [KernelChoice::Askgui, KernelChoice::Reference] {
        let mut m = model();
        m.set_kernels(kernels);
        for new_cache in [KvCache::in_pool, KvCache::whole_in_pool, KvCache::unsplit_in_pool] {
            let pool = KvPool::new(0);
            let (prompt, other) = (ids(1, 100), ids(2, 40));
            let (mut a, mut d) = (new_cache(pool.clone()), new_cache(pool.clone()));
            step(&m, &mut [&mut a, &mut d], &[&prompt, &other]);
            let forks: [&[u32]; 4] = [&[5, 6, 7, 8, 9], &[10], &[11, 12, 13], &[14, 15, 16, 17, 18, 19, 20]];
            let lens: Vec<usize> = forks.iter().map(|f| f.len()).collect();
            let fork_ids = forks.concat();
            let mut pos: Vec<[u32; 3]> = lens.iter().flat_map(|&n| (100..100 + n as u32).map(|p| [p; 3])).collect();
            pos.push([40; 3]);
            let rows: Vec<u32> = fork_ids.iter().copied().chain([21]).collect();
            let new = [NewRows::Forks(&lens), NewRows::Append(1)];
            let positions = positions_tensor(&[pos], rows.len()).unwrap();
            let hidden = m.decode_packed(&embed(&m, &rows), &positions, &new, &mut [&mut a, &mut d]).unwrap();
            let logits = m.logits(&hidden.squeeze(0).unwrap()).unwrap();
            let mut at = 0;
            for (f, fork) in forks.iter().enumerate() {
                let seq: Vec<u32> = prompt.iter().chain(fork.iter()).copied().collect();
                let n = fork.len();
                let want = full_logits(&m, &seq).narrow(0, 100, n).unwrap();
                close(&format!("{kernels:?}: fork {f}"), &logits.narrow(0, at, n).unwrap(), &want);
                at += n;
            }
            let d_ids: Vec<u32> = other.iter().copied().chain([21]).collect();
            close(
                &format!("{kernels:?}: the appending sequence"),
                &logits.narrow(0, at, 1).unwrap(),
                &full_logits(&m, &d_ids).narrow(0, 40, 1).unwrap(),
            );
            assert_eq!((a.len(), d.len()), (100, 41), "forks append nothing; the other sequence its token");
            // The cache goes on as if the forks had never run.
            let next = step(&m, &mut [&mut a], &[&[22]]);
            let seq: Vec<u32> = prompt.iter().copied().chain([22]).collect();
            close(
                &format!("{kernels:?}: after the forks"),
                &next[0],
                &full_logits(&m, &seq).narrow(0, 100, 1).unwrap(),
            );
        }
    }
}

/// Forks without rows are refused with a message, not run.
#[test]
fn empty_forks_are_refused() {
    let m = model();
    let mut a = m.new_cache();
    step(&m, &mut [&mut a], &[&ids(1, 10)]);
    let pos = positions_tensor(&[vec![[10; 3]; 2]], 2).unwrap();
    let err = m.decode_packed(&embed(&m, &[3, 4]), &pos, &[NewRows::Forks(&[2, 0])], &mut [&mut a]).unwrap_err();
    assert!(err.to_string().contains("at least one row"), "{err}");
}

#[test]
fn blocks_are_counted_once_however_shared_and_returned_whatever_ends_a_sequence() {
    let m = model();
    let layers = m.cfg.text.num_hidden_layers;
    let pool = KvPool::new(0);
    let mut a = KvCache::in_pool(pool.clone());
    step(&m, &mut [&mut a], &[&ids(2, 3 * KV_BLOCK + 4)]);
    assert_eq!(pool.blocks_in_use(), 4 * layers, "three full blocks and a partial one per layer");
    let mut b = a.truncated(2 * KV_BLOCK + 6).unwrap();
    let c = a.clone();
    assert_eq!(pool.blocks_in_use(), 4 * layers, "a fork and a prefix share every block");
    step(&m, &mut [&mut b], &[&[5]]);
    assert_eq!(pool.blocks_in_use(), 5 * layers, "writing into a shared, cut block copies that block only");
    // A holder that panics gives its blocks back as it unwinds.
    let mut d = c.clone();
    let panicked = std::thread::spawn(move || {
        step(&m, &mut [&mut d], &[&[9; KV_BLOCK]]);
        panic!("a job dies holding its cache");
    })
    .join();
    assert!(panicked.is_err());
    assert_eq!(pool.blocks_in_use(), 5 * layers, "the panicked holder's new blocks went back");
    drop((a, b, c));
    assert_eq!(pool.blocks_in_use(), 0);
}

/// One block per layer holds a ticket for each [`KV_BLOCK`] its positions fill; a fork shares it until it
/// writes, and then holds a copy of its own.
#[test]
fn whole_layer_blocks_count_their_positions() {
    let m = model();
    let layers = m.cfg.text.num_hidden_layers;
    let pool = KvPool::new(0);
    let mut a = KvCache::whole_in_pool(pool.clone());
    step(&m, &mut [&mut a], &[&ids(6, 3 * KV_BLOCK + 4)]);
    assert_eq!(pool.blocks_in_use(), 4 * layers);
    let mut b = a.clone();
    assert_eq!(pool.blocks_in_use(), 4 * layers, "a fork shares");
    step(&m, &mut [&mut b], &[&[5]]);
    assert_eq!(pool.blocks_in_use(), 8 * layers, "and writes a copy of its own");
    drop((a, b));
    assert_eq!(pool.blocks_in_use(), 0);
}

#[test]
fn a_full_pool_refuses_new_blocks_and_recovers() {
    let m = model();
    let layers = m.cfg.text.num_hidden_layers;
    let pool = KvPool::new(2 * layers);
    let mut a = KvCache::in_pool(pool.clone());
    step(&m, &mut [&mut a], &[&ids(3, 2 * KV_BLOCK)]);
    assert_eq!(pool.blocks_in_use(), 2 * layers);
    let mut b = KvCache::in_pool(pool.clone());
    let n = 4;
    let pos = positions_tensor(&[(0..n).map(|p| [p as u32; 3]).collect()], n).unwrap();
    let err = m.decode_packed(&embed(&m, &ids(4, n)), &pos, &[NewRows::Append(n)], &mut [&mut b]).unwrap_err();
    assert!(matches!(err, ModelError::KvCacheFull { capacity } if capacity == 2 * layers), "{err}");
    drop((a, b));
    assert_eq!(pool.blocks_in_use(), 0, "a failed append leaves nothing behind once its cache is dropped");
    let mut c = KvCache::in_pool(pool.clone());
    step(&m, &mut [&mut c], &[&ids(5, KV_BLOCK)]);
    assert_eq!(pool.blocks_in_use(), layers, "the pool serves again");
}

/// A prefill kept as one block (as on CUDA) holds a ticket for each [`KV_BLOCK`] its positions fill; forks
/// and cut prefixes share it and put their next positions in blocks of their own, never copying it.
#[test]
fn unsplit_prefills_count_their_positions_and_are_never_copied() {
    let m = model();
    let layers = m.cfg.text.num_hidden_layers;
    let pool = KvPool::new(0);
    let mut a = KvCache::unsplit_in_pool(pool.clone());
    step(&m, &mut [&mut a], &[&ids(7, 3 * KV_BLOCK + 4)]);
    assert_eq!(pool.blocks_in_use(), 4 * layers, "one block of four KV_BLOCKs' tickets per layer");
    // 30 more positions: in 32-position blocks they would fill A's partial block (a copy) and start another.
    let mut b = a.clone();
    step(&m, &mut [&mut b], &[&ids(8, KV_BLOCK - 2)]);
    assert_eq!(pool.blocks_in_use(), 5 * layers, "a fork's next positions start a block; the prefill is shared");
    let mut c = a.truncated(2 * KV_BLOCK + 6).unwrap();
    step(&m, &mut [&mut c], &[&[6]]);
    assert_eq!(pool.blocks_in_use(), 6 * layers, "so does a cut prefix's, read in place");
    drop((a, b, c));
    assert_eq!(pool.blocks_in_use(), 0);
}
