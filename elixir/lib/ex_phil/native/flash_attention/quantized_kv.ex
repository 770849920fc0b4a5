defmodule ExPhil.Native.FlashAttention.QuantizedKV do
  @moduledoc """
  A KV cache `{batch, seq, kv_heads, head_dim}` in the 4- or 8-bit affine format of
  `ExPhil.Native.FlashAttention.quantize_kv/2` (Python's `flash_nif.QuantizedKV`, field for
  field). Each group of `group_size` consecutive head-dim elements of one cache row is stored as
  codes `q` in `[0, 2^bits - 1]` with `x ≈ scale * q + bias`, `scale = (max - min) / (2^bits - 1)`
  and `bias = min` (MLX's format; `flash_nif.reference.quantize_kv` defines it bit for bit).

    * `values` — `{:u, 32}` `{batch, seq, kv_heads, head_dim * bits / 32}`: the codes, packed
      from the lowest bits of each word up;
    * `scales`, `biases` — `{batch, seq, kv_heads, head_dim / group_size}` in the cache's float
      type;
    * `bits` — 4 or 8; `group_size` — 32 or 64 (it must divide `head_dim`);
    * `shape`, `type` — the cache's shape and float type, derived from the parts by
      `quantize_kv/2` and `new/5` (the functions read the parts, not these two).

  The parts are `ExPhil.Native.FlashAttention.Tensor` structs, or Nx tensors when the cache was
  quantized from one. `put_seq/3` writes new tokens' rows into a preallocated cache.
  """

  alias ExPhil.Native.FlashAttention.Tensor

  @enforce_keys [:values, :scales, :biases, :bits, :group_size]
  defstruct [:values, :scales, :biases, :bits, :group_size, :shape, :type]

  @type t :: %__MODULE__{
          values: Tensor.t() | struct,
          scales: Tensor.t() | struct,
          biases: Tensor.t() | struct,
          bits: 4 | 8,
          group_size: 32 | 64,
          shape: {non_neg_integer, non_neg_integer, non_neg_integer, non_neg_integer} | nil,
          type: Tensor.type() | nil
        }

  @doc """
  A quantized cache from its parts (as `quantize_kv/2` returns them, or as Python's
  `QuantizedKV` holds them), with `shape` and `type` derived from them. The parts are checked
  when a function reads them, not here.
  """
  @spec new(Tensor.t() | struct, Tensor.t() | struct, Tensor.t() | struct, integer, integer) :: t
  def new(values, scales, biases, bits, group_size) do
    shape =
      case {shape_of(values), bits} do
        {{b, s, h, words}, bits} when bits in [4, 8] -> {b, s, h, div(words * 32, bits)}
        _ -> nil
      end

    %__MODULE__{
      values: values,
      scales: scales,
      biases: biases,
      bits: bits,
      group_size: group_size,
      shape: shape,
      type: type_of(scales)
    }
  end

  @doc """
  `cache` with `new`'s rows written at sequence positions `start .. start + n - 1` of every
  batch row (`start` an integer, or a list with one start per batch row: ragged caches). `new`
  is a quantized `{batch, n, kv_heads, head_dim}` with the same bits, group size and type, e.g.
  `quantize_kv/2` of the new tokens' keys or values. Parts must be `Tensor` structs (with Nx,
  use `Nx.put_slice/3` on each part); see `Tensor.put_seq/3`, which this applies to each part.
  Raises `ArgumentError` on mismatched caches.
  """
  @spec put_seq(t, non_neg_integer | [non_neg_integer], t) :: t
  def put_seq(%__MODULE__{} = cache, start, %__MODULE__{} = new) do
    if {cache.bits, cache.group_size} != {new.bits, new.group_size} do
      raise ArgumentError,
            "put_seq/3: the cache is #{cache.bits}-bit with group size #{cache.group_size}, the new " <>
              "rows #{new.bits}-bit with group size #{new.group_size}"
    end

    %{
      cache
      | values: Tensor.put_seq(cache.values, start, new.values),
        scales: Tensor.put_seq(cache.scales, start, new.scales),
        biases: Tensor.put_seq(cache.biases, start, new.biases)
    }
  end

  defp shape_of(%Tensor{shape: shape}), do: shape
  defp shape_of(%{__struct__: Nx.Tensor} = t), do: Nx.shape(t)
  defp shape_of(_), do: nil

  defp type_of(%Tensor{type: type}), do: type
  defp type_of(%{__struct__: Nx.Tensor} = t), do: Nx.type(t)
  defp type_of(_), do: nil

  defimpl Inspect do
    # Like Python's repr: the cache's description, not its binaries.
    def inspect(c, _opts) do
      "#ExPhil.Native.FlashAttention.QuantizedKV<shape: #{Kernel.inspect(c.shape)}, type: " <>
        "#{Kernel.inspect(c.type)}, bits: #{Kernel.inspect(c.bits)}, group_size: #{Kernel.inspect(c.group_size)}>"
    end
  end
end
