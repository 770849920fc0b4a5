//! The CPU calls' parallel loops: on rayon's pool, or on the calling thread for a small call.
//! Handing a loop to the pool and waiting for it (a futex wake-up and a sleep each way) costs
//! ~5-20 us on a loaded 2-core host, and a forward runs five such loops, a backward ten: the
//! tiny shapes of a decode step or of ExPhil's 60-frame window spent most of their time in those
//! hand-offs (bench/RESULTS.md). A call whose work one core would do in less than
//! [`small_call_ns`] (by the caller's rough estimate: [`attention_ns`], or bytes through a pass)
//! runs every loop here, each item's work the same, so its results are the pool's bits.

use rayon::prelude::*;
use std::cell::Cell;

/// One core's time below which a call runs on its calling thread: what the pool's threads save
/// grows with their number, so 200 us over the threads, within [40, 100] us. Measured
/// (bench/RESULTS.md): on the 2-core VM inline and pooled level at ~75 us (forward) and
/// ~125-185 us (backward) of the estimates; on a 16-core Xeon inline faster at a 36 us forward,
/// slower at a 90 us backward.
pub(crate) fn small_call_ns() -> f64 {
    (200_000.0 / rayon::current_num_threads().max(1) as f64).clamp(40_000.0, 100_000.0)
}

/// One core's time for `macs` multiply-adds of the attention products, roughly: the small tiles'
/// f32 rate with the softmax and the layout passes around them.
pub(crate) fn attention_ns(macs: f64) -> f64 {
    macs * 0.02
}

/// One core's time for a pass over `bytes` bytes (quantizing, merging, turning rows), roughly.
pub(crate) fn pass_ns(bytes: f64) -> f64 {
    bytes * 0.5
}

thread_local! {
    static INLINE: Cell<bool> = const { Cell::new(false) };
    static POOL_ONLY: Cell<bool> = const { Cell::new(false) };
}

/// Runs `f` (one whole call) with its loops on this thread when one core would take less than
/// [`small_call_ns`] (`ns`: the caller's estimate).
pub(crate) fn call<R>(ns: f64, f: impl FnOnce() -> R) -> R {
    with_flag(&INLINE, INLINE.get() || (!POOL_ONLY.get() && ns < small_call_ns()), f)
}

/// Runs `f` with every call's loops on rayon's pool, whatever the call's size (tests: a small call
/// gives the pool's bits).
#[doc(hidden)]
pub fn on_the_pool<R>(f: impl FnOnce() -> R) -> R {
    with_flag(&POOL_ONLY, true, f)
}

/// Runs `f` with `flag` set to `value`, then restores it (also when f panics: the callers catch it).
fn with_flag<R>(flag: &'static std::thread::LocalKey<Cell<bool>>, value: bool, f: impl FnOnce() -> R) -> R {
    struct Restore(&'static std::thread::LocalKey<Cell<bool>>, bool);
    impl Drop for Restore {
        fn drop(&mut self) {
            self.0.set(self.1);
        }
    }
    let _restore = Restore(flag, flag.replace(value));
    f()
}

fn inline() -> bool {
    INLINE.get()
}

/// `f(i, chunk)` for every `n`-element chunk of `data` (the last may be shorter).
pub(crate) fn chunks_mut<T: Send>(data: &mut [T], n: usize, f: impl Fn(usize, &mut [T]) + Sync + Send) {
    if inline() {
        data.chunks_mut(n).enumerate().for_each(|(i, c)| f(i, c));
    } else {
        data.par_chunks_mut(n).enumerate().for_each(|(i, c)| f(i, c));
    }
}

/// `f(item)` for every item.
pub(crate) fn each<T: Send>(items: Vec<T>, f: impl Fn(T) + Sync + Send) {
    if inline() {
        items.into_iter().for_each(f);
    } else {
        items.into_par_iter().for_each(f);
    }
}

/// `f(&mut state, i)` for i in 0..n, each thread's state from `init` (made once a thread, or as
/// rayon splits the range).
pub(crate) fn each_init<S>(n: usize, init: impl Fn() -> S + Sync + Send, f: impl Fn(&mut S, usize) + Sync + Send) {
    if inline() {
        let mut state = init();
        (0..n).for_each(|i| f(&mut state, i));
    } else {
        (0..n).into_par_iter().for_each_init(init, f);
    }
}

/// [`chunks_mut`] with each thread's state from `init`, and at least `min_len` chunks a rayon job.
pub(crate) fn chunks_mut_init<T: Send, S>(data: &mut [T], n: usize, min_len: usize, init: impl Fn() -> S + Sync + Send,
                                         f: impl Fn(&mut S, usize, &mut [T]) + Sync + Send) {
    if inline() {
        let mut state = init();
        data.chunks_mut(n).enumerate().for_each(|(i, c)| f(&mut state, i, c));
    } else {
        data.par_chunks_mut(n).with_min_len(min_len).enumerate().for_each_init(init, |state, (i, c)| f(state, i, c));
    }
}
