//! `rotary/3` and `rotary_backward/3`: rotary position embeddings for
//! `ExPhil.Native.FlashAttention.rotary/4` and `rotary_backward/4` (the core's `RotaryProblem`
//! validates; this decodes and maps errors).

use crate::reply::{guard, Reason};
use crate::tensor::{IndexTensor, Output};
use flash_core::{rotary_host, Device, Positions, RotaryIo, RotaryOptions, RotaryProblem};
use rustler::{Env, Term};

rustler::atoms! {
    interleaved,
    device,
}

/// `%{interleaved: boolean, device: :auto | :cpu | :cuda}`, every key present.
fn options(map: Term) -> Result<(bool, Device), Reason> {
    let bad = || Reason::argument("options must be a map %{interleaved: boolean, device: atom}".into());
    let inter: bool = map.map_get(interleaved()).and_then(|t| t.decode()).map_err(|_| bad())?;
    let dev = map.map_get(device()).map_err(|_| bad())?.atom_to_string().map_err(|_| bad())?;
    Ok((inter, Device::parse(&dev)?))
}

/// `nil` (offset 0), an integer offset, or an int32 `{b, s}` tensor.
enum PositionsArg<'a> {
    Offset(i64),
    Array(IndexTensor<'a>),
}

impl<'a> PositionsArg<'a> {
    fn decode(term: Term<'a>) -> Result<PositionsArg<'a>, Reason> {
        if let Ok(offset) = term.decode::<i64>() {
            return Ok(PositionsArg::Offset(offset));
        }
        if term.atom_to_string().is_ok_and(|a| a == "nil") {
            return Ok(PositionsArg::Offset(0));
        }
        Ok(PositionsArg::Array(IndexTensor::decode(term, "positions")?))
    }

    fn core(&self) -> Positions<'_> {
        match self {
            PositionsArg::Offset(o) => Positions::Offset(*o),
            PositionsArg::Array(a) => Positions::Array(a.arg()),
        }
    }
}

fn run<'a>(env: Env<'a>, tensors: Term<'a>, positions: Term<'a>, opts: Term<'a>, backward: bool) -> Term<'a> {
    guard(env, || {
        let (interleaved, device) = options(opts)?;
        let names = [if backward { "dy" } else { "x" }, "cos", "sin"];
        let [x, cos, sin] = crate::inputs(tensors, names)?;
        let pos = PositionsArg::decode(positions)?;
        let o = RotaryOptions { interleaved, positions: pos.core() };
        let p = if backward {
            RotaryProblem::backward(&x.spec(), &cos.spec(), &sin.spec(), &o)?
        } else {
            RotaryProblem::apply(&x.spec(), &cos.spec(), &sin.spec(), &o)?
        };
        let mut y = Output::alloc(if backward { "dx" } else { "y" }, &p.dims.x_shape(), p.dtype)?;
        let positions = match &pos {
            PositionsArg::Array(a) => Some(a.bytes()),
            PositionsArg::Offset(_) => None,
        };
        let io = RotaryIo { x: x.bytes(), cos: cos.bytes(), sin: sin.bytes(), positions, y: y.bytes_mut() };
        rotary_host(device, &p, io)?;
        Ok(vec![y.encode(env)])
    })
}

/// `rotary([x, cos, sin], positions, options)` → `{:ok, {y, shape}}`: x `[B, S, H, D]`, cos and sin
/// float32 `[max_pos, R/2]`; positions `nil`, an integer offset or an int32 `[B, S]` tensor.
#[rustler::nif(schedule = "DirtyCpu")]
fn rotary<'a>(env: Env<'a>, tensors: Term<'a>, positions: Term<'a>, opts: Term<'a>) -> Term<'a> {
    run(env, tensors, positions, opts, false)
}

/// `rotary_backward([dy, cos, sin], positions, options)` → `{:ok, {dx, shape}}`: the transpose
/// rotation, with the forward's tables, positions and options.
#[rustler::nif(schedule = "DirtyCpu")]
fn rotary_backward<'a>(env: Env<'a>, tensors: Term<'a>, positions: Term<'a>, opts: Term<'a>) -> Term<'a> {
    run(env, tensors, positions, opts, true)
}
