//! Score modifiers, applied to one score in this order (reference.py's `scores`):
//!
//! * `s = scale · q·k`;
//! * `softcap = c` (c > 0): `s = c · tanh(s / c)` (Gemma 2);
//! * `alibi_slopes` (f32 `[H]` or `[B, H]`): `s -= slope · |i + diag0 − j|`, row i and key j in the
//!   batch row's own coordinates ([`Seq`](crate::mask::Seq)), `diag0 = k_hi − q_len` — the masks'
//!   `i + off − j_rel` with `off` and the relative key index of the masks issue;
//! * then the masks, then the softmax, whose denominator may hold one attention sink per head
//!   (`sinks`, f32 `[H]`): `lse = log(Σ_j exp(s_j) + exp(sink_h))`, and the backward returns
//!   `dsinks[h] = −Σ_rows exp(sink_h − lse) · delta`.
//!
//! The slopes and sinks are tiny, so every binding copies them to the host; the GPU backend
//! uploads them with the call.

use crate::error::{FlashError, Result};
use crate::problem::TensorSpec;

/// A small float32 tensor the binding copied to the host (`values` in row-major order).
#[derive(Debug, Clone, Copy)]
pub struct FloatArg<'a> {
    pub spec: TensorSpec<'a>,
    pub values: &'a [f32],
}

/// The modifier tensors of a call, as the binding describes them; `None` = not given.
#[derive(Debug, Clone, Copy, Default)]
pub struct ModArgs<'a> {
    pub alibi_slopes: Option<FloatArg<'a>>,
    pub sinks: Option<FloatArg<'a>>,
}

/// The largest magnitude a modifier value may have (and 1 / it the smallest softcap): the kernels
/// scale softcap, slopes and sinks by log2(e) in float32 (softcap also by its reciprocal), so values
/// near float32's limits overflow and give NaN (measured: a softcap, slope or sink of 3e38 did).
/// Far past any real model's values.
pub const MODIFIER_LIMIT: f64 = 1e30;

/// The validated modifiers of one call (all `None`: plain attention).
#[derive(Debug, Clone, PartialEq, Default)]
pub struct Modifiers {
    pub softcap: Option<f32>,
    /// `[B, H]` slopes (an `[H]` argument repeated over the batch).
    pub alibi: Option<Vec<f32>>,
    /// `[H]` sink logits (natural log units).
    pub sinks: Option<Vec<f32>>,
}

impl Modifiers {
    /// Validates a softcap option: finite and positive.
    pub fn with_softcap(softcap: Option<f64>) -> Result<Modifiers> {
        match softcap {
            None => Ok(Modifiers::default()),
            Some(c) if (1.0 / MODIFIER_LIMIT..=MODIFIER_LIMIT).contains(&c) => Ok(Modifiers { softcap: Some(c as f32), ..Modifiers::default() }),
            Some(c) => Err(FlashError::Unsupported(format!(
                "softcap must be a finite positive number in [{:e}, {MODIFIER_LIMIT:e}], got {c}",
                1.0 / MODIFIER_LIMIT
            ))),
        }
    }

    /// Adds the tensors of `args` for a call of `batch` rows and `heads` query heads.
    pub fn with_tensors(self, args: &ModArgs, batch: usize, heads: usize) -> Result<Modifiers> {
        let alibi = match &args.alibi_slopes {
            None => None,
            Some(a) => {
                let v = checked_floats(a, &[&[heads], &[batch, heads]], "[H] or [B, H]")?;
                Some(if a.spec.shape.len() == 1 { v.repeat(batch) } else { v })
            }
        };
        let sinks = match &args.sinks {
            None => None,
            Some(s) => Some(checked_floats(s, &[&[heads]], "[H]")?),
        };
        Ok(Modifiers { alibi, sinks, ..self })
    }

    /// No modifier: the plain kernels apply.
    pub fn is_none(&self) -> bool {
        self.softcap.is_none() && self.alibi.is_none() && self.sinks.is_none()
    }

    /// ALiBi slope of (batch row b, head h), `None` without ALiBi.
    pub fn slope(&self, b: usize, h: usize, heads: usize) -> Option<f32> {
        self.alibi.as_ref().map(|a| a[b * heads + h])
    }

    /// Sink logit of head h, `None` without sinks.
    pub fn sink(&self, h: usize) -> Option<f32> {
        self.sinks.as_ref().map(|s| s[h])
    }
}

/// The values of a float32 argument whose shape is one of `shapes` (described as `layout`),
/// all finite.
fn checked_floats(a: &FloatArg, shapes: &[&[usize]], layout: &str) -> Result<Vec<f32>> {
    let name = a.spec.name;
    match a.spec.dtype {
        "float32" | "f32" => {}
        d => return Err(FlashError::DType(format!("{name} has dtype {d}; it must be float32"))),
    }
    if !shapes.contains(&a.spec.shape) {
        let want: Vec<String> = shapes.iter().map(|s| format!("{s:?}")).collect();
        return Err(FlashError::Shape(format!(
            "{name} has shape {:?}; expected {layout} = {}",
            a.spec.shape,
            want.join(" or ")
        )));
    }
    let n: usize = a.spec.shape.iter().product();
    if a.values.len() != n {
        return Err(FlashError::Shape(format!("{name} has {} values; its shape {:?} needs {n}", a.values.len(), a.spec.shape)));
    }
    if let Some(x) = a.values.iter().find(|x| !x.is_finite()) {
        return Err(FlashError::Unsupported(format!("{name} must be finite; it holds {x}")));
    }
    if let Some(x) = a.values.iter().find(|x| x.abs() > MODIFIER_LIMIT as f32) {
        return Err(FlashError::Unsupported(format!("{name} must be at most {MODIFIER_LIMIT:e} in magnitude; it holds {x:e}")));
    }
    Ok(a.values.to_vec())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn arg<'a>(name: &'a str, shape: &'a [usize], values: &'a [f32]) -> FloatArg<'a> {
        FloatArg { spec: TensorSpec { name, dtype: "float32", shape, nbytes: None }, values }
    }

    #[test]
    fn slopes_broadcast_and_shapes_are_checked() {
        let v = [0.5f32, 0.25];
        let m = Modifiers::default().with_tensors(&ModArgs { alibi_slopes: Some(arg("alibi_slopes", &[2], &v)), sinks: None }, 3, 2).unwrap();
        assert_eq!(m.slope(2, 1, 2), Some(0.25));
        let bad = Modifiers::default().with_tensors(&ModArgs { alibi_slopes: Some(arg("alibi_slopes", &[3], &[0.0; 3])), sinks: None }, 3, 2);
        assert!(matches!(bad, Err(FlashError::Shape(m)) if m.contains("alibi_slopes")));
        let inf = Modifiers::default().with_tensors(&ModArgs { alibi_slopes: None, sinks: Some(arg("sinks", &[2], &[0.0, f32::INFINITY])) }, 3, 2);
        assert!(matches!(inf, Err(FlashError::Unsupported(m)) if m.contains("sinks")));
        assert!(Modifiers::with_softcap(Some(0.0)).is_err());
        assert!(Modifiers::with_softcap(Some(f64::NAN)).is_err());
        assert_eq!(Modifiers::with_softcap(Some(30.0)).unwrap().softcap, Some(30.0));
    }

    #[test]
    fn values_that_overflow_float32_once_scaled_are_refused() {
        for c in [3e38, 1e31, 1e-31, 1e-40] {
            assert!(matches!(Modifiers::with_softcap(Some(c)), Err(FlashError::Unsupported(m)) if m.contains("softcap")), "{c}");
        }
        for c in [MODIFIER_LIMIT, 1.0 / MODIFIER_LIMIT] {
            assert!(Modifiers::with_softcap(Some(c)).is_ok(), "{c}");
        }
        for x in [3e38f32, -3e38, 2e30] {
            let big = [0.5, x];
            let m = Modifiers::default().with_tensors(&ModArgs { alibi_slopes: Some(arg("alibi_slopes", &[2], &big)), sinks: Some(arg("sinks", &[2], &big)) }, 1, 2);
            assert!(matches!(m, Err(FlashError::Unsupported(m)) if m.contains("alibi_slopes") && m.contains("magnitude")), "{x}");
        }
        let ok = [1e30f32, -1e30];
        assert!(Modifiers::default().with_tensors(&ModArgs { alibi_slopes: Some(arg("alibi_slopes", &[2], &ok)), sinks: Some(arg("sinks", &[2], &ok)) }, 1, 2).is_ok());
    }
}
