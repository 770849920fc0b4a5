//! The non-tensor halves of a call: its options map and its mask tensors. The Elixir wrapper
//! checks options first, with messages in its own terms, and fills every default; what fails
//! here is a term the wrapper never sends (the stubs module called directly): an `:argument` error.

use crate::reply::Reason;
use crate::tensor::{FloatTensor, HostTensor, IndexTensor};
use flash_core::{Device, MaskArgs, MaskBuffers, ModArgs, Mode, Options, Precision, Window};
use rustler::{Atom, Decoder, Term};

rustler::atoms! {
    causal,
    scale,
    device,
    deterministic,
    window,
    segment_ids,
    seqused_k,
    leftpad_k,
    block_mask,
    softcap,
    alibi_slopes,
    sinks,
    nil,
    mode,
    dlse,
    precision,
}

pub(crate) fn field<'a, T: Decoder<'a>>(map: Term<'a>, key: Atom, name: &str, what: &str) -> Result<T, Reason> {
    map.map_get(key)
        .and_then(|t| t.decode())
        .map_err(|_| Reason::argument(format!("options must be a map whose {name} is {what}")))
}

/// `%{causal: boolean, scale: nil | float, device: :auto | :cpu | :cuda, deterministic: boolean,
/// window: {nil | integer, nil | integer}, mode: :auto | :fused | :materialized, precision: :exact | :tf32,
/// softcap: nil | float,
/// alibi_slopes: nil | tensor, sinks: nil | tensor}` (`nil`: unbounded side, or not given), every key
/// present. The modifier tensors are [`Mods::decode`]'s.
pub fn options(map: Term) -> Result<(Options, Device), Reason> {
    let (left, right): (Option<i64>, Option<i64>) =
        field(map, window(), "window", "{nil | integer, nil | integer}")?;
    let opts = Options {
        causal: field(map, causal(), "causal", "a boolean")?,
        scale: field(map, scale(), "scale", "nil or a float")?,
        deterministic: field(map, deterministic(), "deterministic", "a boolean")?,
        window: Window { left, right },
        softcap: field(map, softcap(), "softcap", "nil or a float")?,
        mode: Mode::parse(&atom_field(map, mode(), "mode")?)?,
        precision: Precision::parse(&atom_field(map, precision(), "precision")?)?,
    };
    let device = atom_field(map, device(), "device")?;
    Ok((opts, Device::parse(&device)?))
}

/// An atom-valued option, as its name.
pub(crate) fn atom_field(map: Term, key: Atom, name: &str) -> Result<String, Reason> {
    let t: Term = field(map, key, name, "an atom")?;
    t.atom_to_string().map_err(|_| Reason::argument(format!("options must be a map whose {name} is an atom")))
}

/// The mask tensors of a padded call, borrowing the caller's binaries.
pub struct Masks<'a> {
    segment_ids: Option<(HostTensor<'a>, HostTensor<'a>)>,
    seqused_k: Option<IndexTensor<'a>>,
    leftpad_k: Option<IndexTensor<'a>>,
    block_mask: Option<HostTensor<'a>>,
}

impl<'a> Masks<'a> {
    /// `%{segment_ids: {seg_q, seg_k}, seqused_k: t, leftpad_k: t, block_mask: t}`, each key
    /// optional (absent: not given).
    pub fn decode(map: Term<'a>) -> Result<Masks<'a>, Reason> {
        if !map.is_map() {
            return Err(Reason::argument("masks must be a map".into()));
        }
        let get = |key: Atom| map.map_get(key).ok();
        let segment_ids = match get(segment_ids()) {
            None => None,
            Some(pair) => {
                let (q, k): (Term, Term) = pair
                    .decode()
                    .map_err(|_| Reason::argument("masks.segment_ids must be a tuple {seg_q, seg_k}".into()))?;
                Some((HostTensor::decode(q, "seg_q")?, HostTensor::decode(k, "seg_k")?))
            }
        };
        Ok(Masks {
            segment_ids,
            seqused_k: get(seqused_k()).map(|t| IndexTensor::decode(t, "seqused_k")).transpose()?,
            leftpad_k: get(leftpad_k()).map(|t| IndexTensor::decode(t, "leftpad_k")).transpose()?,
            block_mask: get(block_mask()).map(|t| HostTensor::decode(t, "block_mask")).transpose()?,
        })
    }

    /// What the core validates.
    pub fn args(&self) -> MaskArgs<'_> {
        MaskArgs {
            segment_ids: self.segment_ids.as_ref().map(|(q, k)| (q.spec(), k.spec())),
            seqused_k: self.seqused_k.as_ref().map(IndexTensor::arg),
            leftpad_k: self.leftpad_k.as_ref().map(IndexTensor::arg),
            block_mask: self.block_mask.as_ref().map(HostTensor::spec),
        }
    }

    /// What the kernels read.
    pub fn buffers(&self) -> MaskBuffers<'_> {
        MaskBuffers {
            seg_q: self.segment_ids.as_ref().map(|(q, _)| q.bytes()),
            seg_k: self.segment_ids.as_ref().map(|(_, k)| k.bytes()),
            block_mask: self.block_mask.as_ref().map(HostTensor::bytes),
        }
    }
}

/// The backward's optional `dlse` tensor (the gradient of lse), in its masks map under `dlse`.
pub fn dlse_tensor(map: Term) -> Result<Option<HostTensor>, Reason> {
    map.map_get(dlse()).ok().map(|t| HostTensor::decode(t, "dlse")).transpose()
}

/// The modifier tensors of a call (in its options map), borrowing the caller's binaries.
pub struct Mods<'a> {
    alibi_slopes: Option<FloatTensor<'a>>,
    sinks: Option<FloatTensor<'a>>,
}

impl<'a> Mods<'a> {
    /// The options map's `alibi_slopes` and `sinks` (`nil`: not given).
    pub fn decode(map: Term<'a>) -> Result<Mods<'a>, Reason> {
        let get = |key: Atom, name: &'a str| -> Result<Option<FloatTensor<'a>>, Reason> {
            match map.map_get(key) {
                Err(_) => Err(Reason::argument(format!("options must be a map with the key {name}"))),
                Ok(t) if t.decode::<Atom>().is_ok_and(|a| a == nil()) => Ok(None),
                Ok(t) => FloatTensor::decode(t, name).map(Some),
            }
        };
        Ok(Mods { alibi_slopes: get(alibi_slopes(), "alibi_slopes")?, sinks: get(sinks(), "sinks")? })
    }

    /// What the core validates.
    pub fn args(&self) -> ModArgs<'_> {
        ModArgs { alibi_slopes: self.alibi_slopes.as_ref().map(FloatTensor::arg), sinks: self.sinks.as_ref().map(FloatTensor::arg) }
    }
}
