//! Working buffers. They come from a small process-wide pool, so a training loop that calls with
//! the same sizes reuses memory instead of faulting in fresh pages on every call, and they are
//! allocated fallibly, so a size too large for memory is an error, not an abort.

use crate::error::{FlashError, Result};
use std::ops::{Deref, DerefMut};
use std::sync::Mutex;

/// Tile sizes: query rows per block and key columns per block.
pub const BLOCK_Q: usize = 64;
pub const BLOCK_K: usize = 128;

/// The pool keeps at most this many buffers and this many bytes in all.
const POOL_BUFFERS: usize = 16;
const POOL_BYTES: usize = 512 << 20;

static POOL: Mutex<Vec<Vec<f32>>> = Mutex::new(Vec::new());

/// An f32 buffer that returns to the pool when dropped.
pub struct Buffer(Vec<f32>);

impl Deref for Buffer {
    type Target = [f32];
    fn deref(&self) -> &[f32] {
        &self.0
    }
}

impl DerefMut for Buffer {
    fn deref_mut(&mut self) -> &mut [f32] {
        &mut self.0
    }
}

impl Drop for Buffer {
    fn drop(&mut self) {
        let v = std::mem::take(&mut self.0);
        let mut pool = POOL.lock().unwrap_or_else(|e| e.into_inner());
        let pooled: usize = pool.iter().map(|b| b.capacity() * 4).sum();
        if pool.len() < POOL_BUFFERS && pooled + v.capacity() * 4 <= POOL_BYTES {
            pool.push(v);
        }
    }
}

pub fn zeroed(len: usize, what: &str) -> Result<Buffer> {
    filled(len, 0.0, what)
}

/// A buffer of `len` elements, all `value`.
pub fn filled(len: usize, value: f32, what: &str) -> Result<Buffer> {
    let reused = {
        let mut pool = POOL.lock().unwrap_or_else(|e| e.into_inner());
        // The smallest pooled buffer that is large enough.
        let best = (0..pool.len()).filter(|&i| pool[i].capacity() >= len).min_by_key(|&i| pool[i].capacity());
        best.map(|i| pool.swap_remove(i))
    };
    let mut v = match reused {
        Some(v) => v,
        None => {
            let mut v = Vec::new();
            v.try_reserve_exact(len).map_err(|_| {
                FlashError::OutOfMemory(format!("cannot allocate {} MiB for {what}", (len as u128 * 4) >> 20))
            })?;
            v
        }
    };
    v.clear();
    v.resize(len, value);
    Ok(Buffer(v))
}
