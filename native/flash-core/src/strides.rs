//! Where the rows of an input tensor lie: element strides of its batch, sequence and head axes, its
//! last (head-dim) axis contiguous. Views such as `qkv.unbind(2)` or a `[B, H, S, D]` transpose are
//! read where they lie, with no copy. Outputs are always packed (the library allocates them).

use crate::error::{FlashError, Result};
use crate::problem::Problem;

/// Element strides of a `[B, S, H, D]` tensor's batch, sequence and head axes; a varlen tensor
/// `[total, H, D]` has no batch axis (batch 0).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Strides {
    pub batch: usize,
    pub seq: usize,
    pub head: usize,
}

impl Strides {
    /// A row-major contiguous tensor of `shape` (`[B, S, H, D]` or varlen `[total, H, D]`).
    pub fn packed(shape: &[usize]) -> Strides {
        let n = shape.len();
        let (h, d) = (shape[n - 2], shape[n - 1]);
        Strides { batch: if n == 4 { shape[1] * h * d } else { 0 }, seq: h * d, head: d }
    }

    /// A binding's per-axis element strides (one per axis of `shape`), checked: the last axis
    /// contiguous (stride 1; any stride where it has length 1), none negative.
    pub fn from_axes(name: &str, shape: &[usize], strides: &[i64]) -> Result<Strides> {
        let n = shape.len();
        if strides.len() != n || !(n == 3 || n == 4) {
            return Err(FlashError::Shape(format!("{name}: {} strides for shape {shape:?}", strides.len())));
        }
        if strides.iter().any(|&s| s < 0) {
            return Err(FlashError::Shape(format!(
                "{name} has negative strides {strides:?}; pass a copy (for example np.ascontiguousarray)"
            )));
        }
        if strides[n - 1] != 1 && shape[n - 1] > 1 {
            return Err(FlashError::Shape(format!(
                "{name} has strides {strides:?}: its last (head_dim) axis must be contiguous (stride 1)"
            )));
        }
        // An axis of length 1 is never stepped over: its packed stride stands in for whatever the
        // array library reports (torch's may be anything), so that packed views compare equal.
        let packed = Strides::packed(shape);
        let pick = |axis: usize, want: usize| if shape[axis] <= 1 { want } else { strides[axis] as usize };
        Ok(if n == 4 {
            Strides { batch: pick(0, packed.batch), seq: pick(1, packed.seq), head: pick(2, packed.head) }
        } else {
            Strides { batch: 0, seq: pick(0, packed.seq), head: pick(1, packed.head) }
        })
    }

    /// Element offset of row (b, s, h).
    pub fn at(&self, b: usize, s: usize, h: usize) -> usize {
        b * self.batch + s * self.seq + h * self.head
    }

    /// Elements from the first element to one past the last (0 for an empty tensor).
    pub fn extent(&self, shape: &[usize]) -> usize {
        if shape.contains(&0) {
            return 0;
        }
        let n = shape.len();
        let (b, s, h, d) = if n == 4 { (shape[0], shape[1], shape[2], shape[3]) } else { (1, shape[0], shape[1], shape[2]) };
        self.at(b - 1, s - 1, h - 1) + d
    }

    /// True when these are `shape`'s packed strides (an axis of length 1 may have any stride).
    pub fn is_packed(&self, shape: &[usize]) -> bool {
        let p = Strides::packed(shape);
        let n = shape.len();
        let axis = |len: usize, a: usize, b: usize| len <= 1 || a == b;
        (n == 3 || axis(shape[0], self.batch, p.batch)) && axis(shape[n - 3], self.seq, p.seq) && axis(shape[n - 2], self.head, p.head)
    }

    /// True when every stride is a multiple of `bytes` bytes for elements of `elem` bytes (the GPU
    /// kernels load 16-byte chunks of rows).
    pub fn aligned(&self, elem: usize, bytes: usize) -> bool {
        [self.batch, self.seq, self.head].iter().all(|&s| (s * elem).is_multiple_of(bytes))
    }
}

/// The strides of a call's input tensors. Forward calls read q, k, v; backward calls also o and d_out.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct InputStrides {
    pub q: Strides,
    pub k: Strides,
    pub v: Strides,
    pub o: Strides,
    pub d_out: Strides,
}

impl InputStrides {
    /// Every input packed, as the call's shapes imply.
    pub fn packed(p: &Problem) -> InputStrides {
        let (q, kv, v, o) = (p.q_shape(), p.kv_shape(), p.v_shape(), p.o_shape());
        InputStrides {
            q: Strides::packed(&q),
            k: Strides::packed(&kv),
            v: Strides::packed(&v),
            o: Strides::packed(&o),
            d_out: Strides::packed(&o),
        }
    }

    /// A forward's: q, k, v where given (None: packed), o and d_out packed.
    pub fn forward(p: &Problem, [q, k, v]: [Option<Strides>; 3]) -> InputStrides {
        let s = InputStrides::packed(p);
        InputStrides { q: q.unwrap_or(s.q), k: k.unwrap_or(s.k), v: v.unwrap_or(s.v), ..s }
    }

    /// A backward's: d_out, q, k, v, o where given (None: packed), in [`BackwardIo`](crate::BackwardIo)'s order.
    pub fn backward(p: &Problem, [d_out, q, k, v, o]: [Option<Strides>; 5]) -> InputStrides {
        let s = InputStrides::packed(p);
        InputStrides { d_out: d_out.unwrap_or(s.d_out), o: o.unwrap_or(s.o), ..InputStrides::forward(p, [q, k, v]) }
    }

    /// True when every input is packed.
    pub fn all_packed(&self, p: &Problem) -> bool {
        let (q, kv, v, o) = (p.q_shape(), p.kv_shape(), p.v_shape(), p.o_shape());
        self.q.is_packed(&q) && self.k.is_packed(&kv) && self.v.is_packed(&v) && self.o.is_packed(&o) && self.d_out.is_packed(&o)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn packed_views_and_extents() {
        let shape = [2, 5, 3, 8];
        let p = Strides::packed(&shape);
        assert_eq!(p, Strides { batch: 120, seq: 24, head: 8 });
        assert_eq!(p.extent(&shape), 240);
        assert!(p.is_packed(&shape));
        // q of qkv.view(B, S, 3, H, D).unbind(2): seq stride 3 H D, head stride D.
        let q = Strides::from_axes("q", &shape, &[360, 72, 8, 1]).unwrap();
        assert!(!q.is_packed(&shape));
        assert_eq!(q.extent(&shape), 360 + 4 * 72 + 2 * 8 + 8);
        // A [B, H, S, D] tensor transposed to [B, S, H, D].
        let t = Strides::from_axes("q", &shape, &[120, 8, 40, 1]).unwrap();
        assert_eq!(t.at(1, 2, 1), 120 + 16 + 40);
        assert_eq!(Strides::packed(&[7, 3, 8]), Strides { batch: 0, seq: 24, head: 8 });
    }

    #[test]
    fn bad_strides_are_errors() {
        assert!(Strides::from_axes("q", &[1, 2, 3, 4], &[24, 12, 4, 2]).is_err());
        assert!(Strides::from_axes("q", &[1, 2, 3, 4], &[24, -12, 4, 1]).is_err());
        assert!(Strides::from_axes("q", &[1, 2, 3, 4], &[12, 4, 1]).is_err());
        assert!(Strides::from_axes("q", &[1, 2, 3, 1], &[6, 3, 1, 7]).is_ok());
        // Length-1 axes take their packed strides.
        assert_eq!(Strides::from_axes("q", &[1, 2, 1, 4], &[0, 4, 99, 1]).unwrap(), Strides::packed(&[1, 2, 1, 4]));
    }
}
