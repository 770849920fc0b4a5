//! Working buffers, allocated fallibly so a size too large for memory is an error, not an abort.

use crate::error::{FlashError, Result};

/// Tile sizes: query rows per block and key columns per block.
pub const BLOCK_Q: usize = 64;
pub const BLOCK_K: usize = 128;

pub fn zeroed(len: usize, what: &str) -> Result<Vec<f32>> {
    filled(len, 0.0, what)
}

pub fn filled(len: usize, value: f32, what: &str) -> Result<Vec<f32>> {
    let mut v = Vec::new();
    v.try_reserve_exact(len).map_err(|_| {
        FlashError::OutOfMemory(format!(
            "cannot allocate {} MiB for {what}",
            (len as u128 * 4) >> 20
        ))
    })?;
    v.resize(len, value);
    Ok(v)
}
