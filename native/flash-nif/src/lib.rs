//! `libflash_nif`: the Rustler NIF behind `ExPhil.Native.FlashAttention` (stubs in
//! `elixir/lib/ex_phil/native/flash_attention/nif.ex`). It decodes binaries into byte slices,
//! lets flash-core validate and compute on a dirty CPU scheduler, and maps errors — nothing else.
//!
//! Every function returns `{:ok, ...}` or `{:error, {kind, message}}` (see [`reply`]); outputs
//! are `{binary, shape_tuple}` pairs (see [`tensor`]). The library is loaded by the Elixir module
//! itself with `:erlang.load_nif/2`, so only the rustler crate is needed, not the hex package.

mod args;
mod kv;
mod reply;
mod rotary;
mod tensor;
mod words;

use args::{options, Masks, Mods};
use flash_core::{backward_host, forward_host, BackwardIo, DType, Device, ForwardIo, MaskBuffers, Problem};
use reply::{guard, Reason};
use rustler::{Encoder, Env, Term};
use tensor::{HostTensor, IndexTensor, Output};

/// The contract between this library and the Elixir stubs (function set and term formats).
/// Bump it on any change: the Elixir side refuses a library that reports another number,
/// which is how a stale build in `priv/` is detected.
const NIF_API: u32 = 7;

rustler::init!("Elixir.ExPhil.Native.FlashAttention.Nif");

/// `{nif_api, version}`: checked by the Elixir side right after loading (cheap, normal scheduler).
#[rustler::nif]
fn nif_api(env: Env) -> Term {
    (NIF_API, flash_core::VERSION).encode(env)
}

/// `{:ok, version, backends, last_kernels}`, last_kernels `[{pass, kernel | nil, not_sm90_because
/// | nil, math | nil}]` for "forward" and "backward" (the GPU kernels this process last ran, and how
/// their products were computed: "3xf16", "3xtf32", "1xf16", "tf32", "f32-simt", "f16", "bf16"); may probe for a
/// CUDA driver, hence a dirty I/O scheduler.
#[rustler::nif(schedule = "DirtyIo")]
fn info(env: Env) -> Term {
    guard(env, || {
        let mut backends = vec!["cpu"];
        if flash_core::cuda_available() {
            backends.push("cuda");
        }
        let last = flash_core::cuda::last_kernels();
        let kernels: Vec<(&str, Option<String>, Option<String>, Option<&str>)> =
            [("forward", last.forward), ("backward", last.backward)]
                .into_iter()
                .map(|(pass, ran)| (pass, ran.kernel, ran.fallback, ran.math))
                .collect();
        Ok(vec![flash_core::VERSION.encode(env), backends.encode(env), kernels.encode(env)])
    })
}

/// The list `terms` of N tensor terms, named `names` in messages.
fn tensors<'a, const N: usize>(terms: Term<'a>, names: [&'static str; N]) -> Result<[Term<'a>; N], Reason> {
    let list: Vec<Term<'a>> = terms.decode().map_err(|_| Reason::argument(format!("expected the list {names:?}")))?;
    list.try_into().map_err(|_| Reason::argument(format!("expected the list {names:?}")))
}

/// The list `terms` of N tensors, decoded.
fn inputs<'a, const N: usize>(terms: Term<'a>, names: [&'static str; N]) -> Result<[HostTensor<'a>; N], Reason> {
    let decoded: Vec<HostTensor> =
        tensors(terms, names)?.into_iter().zip(names).map(|(t, name)| HostTensor::decode(t, name)).collect::<Result<_, _>>()?;
    Ok(decoded.try_into().unwrap_or_else(|_| unreachable!("one tensor per term")))
}

/// `[cu_seqlens_q, cu_seqlens_k]`.
fn cu_seqlens(terms: Term) -> Result<[IndexTensor; 2], Reason> {
    let names = ["cu_seqlens_q", "cu_seqlens_k"];
    let [q, k] = tensors(terms, names)?;
    Ok([IndexTensor::decode(q, names[0])?, IndexTensor::decode(k, names[1])?])
}

/// Runs a validated forward: `[o, lse]` as `{binary, shape}` terms.
fn run_forward<'a>(
    env: Env<'a>, device: Device, p: &Problem, t: &[HostTensor; 3], masks: MaskBuffers,
) -> Result<Vec<Term<'a>>, Reason> {
    let mut o = Output::alloc("o", &p.o_shape(), p.dtype)?;
    let mut lse = Output::alloc("lse", &p.lse_shape(), DType::F32)?;
    let io = ForwardIo::new(t.each_ref().map(HostTensor::bytes), [o.bytes_mut(), lse.bytes_mut()]).with_mask(masks);
    forward_host(device, p, io)?;
    Ok(vec![o.encode(env), lse.encode(env)])
}

/// Runs a validated backward: `[dq, dk, dv]`, and `dsinks` (`[H]` float32) when `p` has sinks.
fn run_backward<'a>(
    env: Env<'a>, device: Device, p: &Problem, a: &[HostTensor; 6], dlse: Option<&HostTensor>, masks: MaskBuffers,
) -> Result<Vec<Term<'a>>, Reason> {
    let mut dq = Output::alloc("dq", &p.q_shape(), p.dtype)?;
    let mut dk = Output::alloc("dk", &p.kv_shape(), p.dtype)?;
    let mut dv = Output::alloc("dv", &p.v_shape(), p.dtype)?;
    let mut dsinks = p.mods.sinks.as_ref().map(|_| Output::alloc("dsinks", &[p.dims.heads], DType::F32)).transpose()?;
    let outs = [dq.bytes_mut(), dk.bytes_mut(), dv.bytes_mut()];
    let mut io = BackwardIo::new(a.each_ref().map(HostTensor::bytes), outs).with_mask(masks);
    if let Some(ds) = dsinks.as_mut() {
        io = io.with_dsinks(ds.bytes_mut());
    }
    if let Some(g) = dlse {
        p.check_dlse(&g.spec())?;
        io = io.with_dlse(g.bytes());
    }
    backward_host(device, p, io)?;
    let mut out = vec![dq.encode(env), dk.encode(env), dv.encode(env)];
    out.extend(dsinks.map(|d| d.encode(env)));
    Ok(out)
}

const FORWARD: [&str; 3] = ["q", "k", "v"];
const BACKWARD: [&str; 6] = ["d_out", "q", "k", "v", "o", "lse"];

/// `forward([q, k, v], masks, options)` → `{:ok, {o, o_shape}, {lse, lse_shape}}` for q
/// `[B, Sq, H, D]`, k `[B, Sk, Hkv, D]` and v `[B, Sk, Hkv, Dv]`: o is `[B, Sq, H, Dv]` (masks
/// and options: see [`args`]).
#[rustler::nif(schedule = "DirtyCpu")]
fn forward<'a>(env: Env<'a>, tensors: Term<'a>, masks: Term<'a>, opts: Term<'a>) -> Term<'a> {
    guard(env, || {
        let opts_map = opts;
        let (opts, device) = options(opts_map)?;
        let t = inputs(tensors, FORWARD)?;
        let (masks, mods) = (Masks::decode(masks)?, Mods::decode(opts_map)?);
        let p = Problem::forward_masked(&t[0].spec(), &t[1].spec(), &t[2].spec(), &opts, &masks.args())?.with_modifiers(&mods.args())?;
        run_forward(env, device, &p, &t, masks.buffers())
    })
}

/// `backward([d_out, q, k, v, o, lse], masks, options)` → `{:ok, {dq, q_shape}, {dk, k_shape},
/// {dv, v_shape}}` (and `{dsinks, {H}}` last with sinks), from the forward's inputs, masks and options, its output `o`, its `lse`
/// (`[B, H, Sq]`, float32) and the output gradient `d_out`; `masks.dlse` (optional, like lse) the
/// gradient of lse.
#[rustler::nif(schedule = "DirtyCpu")]
fn backward<'a>(env: Env<'a>, tensors: Term<'a>, masks: Term<'a>, opts: Term<'a>) -> Term<'a> {
    guard(env, || {
        let opts_map = opts;
        let (opts, device) = options(opts_map)?;
        let t = inputs(tensors, BACKWARD)?;
        let masks_map = masks;
        let (masks, mods) = (Masks::decode(masks)?, Mods::decode(opts_map)?);
        let p = Problem::backward_masked(t.each_ref().map(HostTensor::spec).each_ref(), &opts, &masks.args())?
            .with_modifiers(&mods.args())?;
        let dlse = args::dlse_tensor(masks_map)?;
        run_backward(env, device, &p, &t, dlse.as_ref(), masks.buffers())
    })
}

/// `varlen_forward([q, k, v], [cu_seqlens_q, cu_seqlens_k], options)`: packed sequences, q
/// `[total_q, H, D]`, k `[total_k, Hkv, D]`, v `[total_k, Hkv, Dv]`; o comes back
/// `[total_q, H, Dv]` and lse `[H, total_q]`.
#[rustler::nif(schedule = "DirtyCpu")]
fn varlen_forward<'a>(env: Env<'a>, tensors: Term<'a>, cu: Term<'a>, opts: Term<'a>) -> Term<'a> {
    guard(env, || {
        let opts_map = opts;
        let (opts, device) = options(opts_map)?;
        let t = inputs(tensors, FORWARD)?;
        let [cu_q, cu_k] = cu_seqlens(cu)?;
        let mods = Mods::decode(opts_map)?;
        let p = Problem::varlen_forward(&t[0].spec(), &t[1].spec(), &t[2].spec(), &cu_q.arg(), &cu_k.arg(), &opts)?
            .with_modifiers(&mods.args())?;
        run_forward(env, device, &p, &t, MaskBuffers::default())
    })
}

/// `varlen_backward([d_out, q, k, v, o, lse], [cu_seqlens_q, cu_seqlens_k], options)`.
#[rustler::nif(schedule = "DirtyCpu")]
fn varlen_backward<'a>(env: Env<'a>, tensors: Term<'a>, cu: Term<'a>, opts: Term<'a>) -> Term<'a> {
    guard(env, || {
        let opts_map = opts;
        let (opts, device) = options(opts_map)?;
        let t = inputs(tensors, BACKWARD)?;
        let [cu_q, cu_k] = cu_seqlens(cu)?;
        let [d_out, q, k, v, o, lse] = t.each_ref().map(HostTensor::spec);
        let mods = Mods::decode(opts_map)?;
        let p = Problem::varlen_backward(&d_out, &q, &k, &v, &o, &lse, [&cu_q.arg(), &cu_k.arg()], &opts)?
            .with_modifiers(&mods.args())?;
        run_backward(env, device, &p, &t, None, MaskBuffers::default())
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
