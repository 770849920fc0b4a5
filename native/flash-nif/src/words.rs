//! 4-byte element views of binaries (u32 codes, i32 lengths, f32 logsumexps) for the core's typed
//! slices. A binary may sit at any alignment (a sub-binary starts anywhere), so an unaligned one is
//! copied instead of misread; an aligned one is used in place.

use std::borrow::Cow;

/// An element type with no invalid bit patterns, 4 bytes wide.
pub trait Word: Copy {
    fn from_ne(b: [u8; 4]) -> Self;
    fn to_ne(self) -> [u8; 4];
}

macro_rules! word {
    ($($t:ty),*) => {$(
        impl Word for $t {
            fn from_ne(b: [u8; 4]) -> Self { <$t>::from_ne_bytes(b) }
            fn to_ne(self) -> [u8; 4] { self.to_ne_bytes() }
        }
    )*};
}
word!(u32, i32, f32);

fn copy<T: Word>(bytes: &[u8]) -> Vec<T> {
    bytes.chunks_exact(4).map(|c| T::from_ne([c[0], c[1], c[2], c[3]])).collect()
}

/// `bytes` as elements: borrowed when aligned, else a copy (a trailing partial element is dropped;
/// the core checks lengths).
pub fn words<T: Word>(bytes: &[u8]) -> Cow<'_, [T]> {
    // SAFETY: T is u32, i32 or f32, for which every bit pattern is a value.
    match unsafe { bytes.align_to::<T>() } {
        ([], mid, []) => Cow::Borrowed(mid),
        _ => Cow::Owned(copy(bytes)),
    }
}

/// Runs `f` on `bytes` as elements, in place when aligned, else on a copy written back after.
pub fn with_words_mut<T: Word, R>(bytes: &mut [u8], f: impl FnOnce(&mut [T]) -> R) -> R {
    // SAFETY: as in `words`.
    if let ([], mid, []) = unsafe { bytes.align_to_mut::<T>() } {
        return f(mid);
    }
    let mut tmp = copy::<T>(bytes);
    let r = f(&mut tmp);
    for (c, w) in bytes.chunks_exact_mut(4).zip(tmp) {
        c.copy_from_slice(&w.to_ne());
    }
    r
}
