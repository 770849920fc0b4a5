//! `libflash_nif`: the Rustler NIF behind `ExPhil.Native.FlashAttention` (stubs in
//! `elixir/lib/ex_phil/native/flash_attention/nif.ex`). It decodes binaries into byte slices,
//! lets flash-core validate and compute on a dirty CPU scheduler, and maps errors — nothing else.
//!
//! Every function returns `{:ok, ...}` or `{:error, {kind, message}}` (see [`reply`]); outputs
//! are `{binary, shape_tuple}` pairs (see [`tensor`]). The library is loaded by the Elixir module
//! itself with `:erlang.load_nif/2`, so only the rustler crate is needed, not the hex package.

mod reply;
mod tensor;

use flash_core::{backward_host, forward_host, BackwardIo, DType, Device, ForwardIo, Options, Problem};
use reply::{guard, Reason};
use rustler::{Encoder, Env, Term};
use tensor::{HostTensor, Output};

/// The contract between this library and the Elixir stubs (function set and term formats).
/// Bump it on any change: the Elixir side refuses a library that reports another number,
/// which is how a stale build in `priv/` is detected.
const NIF_API: u32 = 2;

rustler::init!("Elixir.ExPhil.Native.FlashAttention.Nif");

/// Decodes `causal` (boolean), `scale` (`nil` or a float) and `device` (`:auto | :cpu | :cuda`).
/// The Elixir wrapper validates these first with friendlier messages; this is the backstop.
/// `deterministic` is set by the backward alone.
fn options(causal: Term, scale: Term, device: Term) -> Result<(Options, Device), Reason> {
    let causal: bool = causal
        .decode()
        .map_err(|_| Reason::argument("causal must be a boolean".into()))?;
    let scale: Option<f64> = scale
        .decode()
        .map_err(|_| Reason::argument("scale must be nil or a float".into()))?;
    let device = device
        .atom_to_string()
        .map_err(|_| Reason::argument("device must be :auto, :cpu or :cuda".into()))?;
    Ok((Options { causal, scale, ..Options::default() }, Device::parse(&device)?))
}

/// `{nif_api, version}`: checked by the Elixir side right after loading (cheap, normal scheduler).
#[rustler::nif]
fn nif_api(env: Env) -> Term {
    (NIF_API, flash_core::VERSION).encode(env)
}

/// `{:ok, version, backends}`; may probe for a CUDA driver, hence a dirty I/O scheduler.
#[rustler::nif(schedule = "DirtyIo")]
fn info(env: Env) -> Term {
    guard(env, || {
        let mut backends = vec!["cpu"];
        if flash_core::cuda_available() {
            backends.push("cuda");
        }
        Ok(vec![flash_core::VERSION.encode(env), backends.encode(env)])
    })
}

/// Decodes the input tensors `terms`, named for messages.
fn inputs<'a, const N: usize>(terms: [Term<'a>; N], names: [&'a str; N]) -> Result<[HostTensor<'a>; N], Reason> {
    let tensors: Vec<HostTensor> =
        terms.into_iter().zip(names).map(|(t, name)| HostTensor::decode(t, name)).collect::<Result<_, _>>()?;
    Ok(tensors.try_into().unwrap_or_else(|_| unreachable!("one tensor per term")))
}

/// `{:ok, {o, o_shape}, {lse, lse_shape}}` for q `[B, Sq, H, D]`, k and v `[B, Sk, Hkv, D]`.
#[rustler::nif(schedule = "DirtyCpu")]
fn forward<'a>(
    env: Env<'a>, q: Term<'a>, k: Term<'a>, v: Term<'a>, causal: Term<'a>, scale: Term<'a>, device: Term<'a>,
) -> Term<'a> {
    guard(env, || {
        let (opts, device) = options(causal, scale, device)?;
        let [q, k, v] = inputs([q, k, v], ["q", "k", "v"])?;
        let p = Problem::forward(&q.spec(), &k.spec(), &v.spec(), &opts)?;
        let mut o = Output::alloc("o", &p.dims.q_shape(), p.dtype)?;
        let mut lse = Output::alloc("lse", &p.dims.lse_shape(), DType::F32)?;
        let io = ForwardIo::new([&q, &k, &v].map(HostTensor::bytes), [o.bytes_mut(), lse.bytes_mut()]);
        forward_host(device, &p, io)?;
        Ok(vec![o.encode(env), lse.encode(env)])
    })
}

/// `{:ok, {dq, q_shape}, {dk, kv_shape}, {dv, kv_shape}}` from the forward's inputs, its output
/// `o`, its `lse` (`[B, H, Sq]`, float32) and the output gradient `d_out`.
#[rustler::nif(schedule = "DirtyCpu")]
#[allow(clippy::too_many_arguments)] // one Rust parameter per argument of the Elixir stub Nif.backward/10
fn backward<'a>(
    env: Env<'a>,
    d_out: Term<'a>,
    q: Term<'a>,
    k: Term<'a>,
    v: Term<'a>,
    o: Term<'a>,
    lse: Term<'a>,
    causal: Term<'a>,
    scale: Term<'a>,
    device: Term<'a>,
    deterministic: Term<'a>,
) -> Term<'a> {
    guard(env, || {
        let (mut opts, device) = options(causal, scale, device)?;
        opts.deterministic = deterministic
            .decode()
            .map_err(|_| Reason::argument("deterministic must be a boolean".into()))?;
        let a = inputs([d_out, q, k, v, o, lse], ["d_out", "q", "k", "v", "o", "lse"])?;
        let [d_out, q, k, v, o, lse] = &a;
        let p = Problem::backward(&d_out.spec(), &q.spec(), &k.spec(), &v.spec(), &o.spec(), &lse.spec(), &opts)?;
        let mut dq = Output::alloc("dq", &p.dims.q_shape(), p.dtype)?;
        let mut dk = Output::alloc("dk", &p.dims.kv_shape(), p.dtype)?;
        let mut dv = Output::alloc("dv", &p.dims.kv_shape(), p.dtype)?;
        let io = BackwardIo::new(a.each_ref().map(HostTensor::bytes), [dq.bytes_mut(), dk.bytes_mut(), dv.bytes_mut()]);
        backward_host(device, &p, io)?;
        Ok(vec![dq.encode(env), dk.encode(env), dv.encode(env)])
    })
}

/// Panics on purpose, so the test suite can check that a panic comes back as
/// `{:error, {:internal, message}}` and the VM lives on. Not part of the public API.
/// (`resume_unwind` unwinds like `panic!` but skips the panic hook, so the test prints nothing.)
#[rustler::nif]
fn debug_panic(env: Env) -> Term {
    guard(env, || {
        std::panic::resume_unwind(Box::new("debug_panic was called"))
    })
}
