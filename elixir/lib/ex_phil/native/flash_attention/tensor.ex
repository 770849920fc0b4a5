defmodule ExPhil.Native.FlashAttention.Tensor do
  @moduledoc """
  A dense tensor as `ExPhil.Native.FlashAttention` takes and returns it.

    * `data` — the elements, row-major, native-endian (exactly what `Nx.to_binary/1` gives);
    * `shape` — a tuple of non-negative integers;
    * `type` — `{:f, 32}`, `{:f, 16}` or `{:bf, 16}` (logsumexp is always `{:f, 32}`); masks
      are `{:s, 32}` (segment ids, lengths, offsets) or `{:u, 8}` (block masks); the codes of a
      quantized KV cache are `{:u, 32}`.

  `from_list/3` and `to_list/1` convert flat lists of numbers for small tensors, tests and
  examples (non-finite values are the atoms `:infinity`, `:neg_infinity` and `:nan`, as in Nx;
  integer types take and give integers).
  """

  @enforce_keys [:data, :shape, :type]
  defstruct [:data, :shape, :type]

  @type type :: {:f, 32} | {:f, 16} | {:bf, 16} | {:s, 32} | {:u, 8} | {:u, 32}
  @type element :: float | integer | :infinity | :neg_infinity | :nan
  @type t :: %__MODULE__{data: binary, shape: tuple, type: type}

  @doc "Number of elements a shape holds."
  @spec size(tuple) :: non_neg_integer
  def size(shape) when is_tuple(shape), do: shape |> Tuple.to_list() |> Enum.reduce(1, &(&1 * &2))

  @doc "Bytes per element of a type."
  @spec byte_size(type) :: 1 | 2 | 4
  def byte_size({:f, 32}), do: 4
  def byte_size({:f, 16}), do: 2
  def byte_size({:bf, 16}), do: 2
  def byte_size({:s, 32}), do: 4
  def byte_size({:u, 8}), do: 1
  def byte_size({:u, 32}), do: 4

  @doc """
  A tensor of `type` holding the numbers of `list` (flat, row-major) in `shape`.
  Values are rounded to nearest-even in a float type; integer types take integers.
  """
  @spec from_list([number | element], tuple, type) :: t
  def from_list(list, shape, type) when is_list(list) and is_tuple(shape) do
    n = size(shape)

    if length(list) != n do
      raise ArgumentError, "from_list/3: #{length(list)} values for shape #{inspect(shape)} (#{n} elements)"
    end

    data = for x <- list, into: <<>>, do: encode(x, type)
    %__MODULE__{data: data, shape: shape, type: type}
  end

  @doc "The elements of `tensor` as a flat list of floats (and `:infinity`/`:neg_infinity`/`:nan`) or integers."
  @spec to_list(t) :: [element]
  def to_list(%__MODULE__{data: data, type: {:f, 32}}), do: for(<<c::binary-size(4) <- data>>, do: f32(c))
  def to_list(%__MODULE__{data: data, type: {:f, 16}}), do: for(<<c::binary-size(2) <- data>>, do: f16(c))
  def to_list(%__MODULE__{data: data, type: {:bf, 16}}), do: for(<<c::binary-size(2) <- data>>, do: bf16(c))
  def to_list(%__MODULE__{data: data, type: {:s, 32}}), do: for(<<x::signed-32-native <- data>>, do: x)
  def to_list(%__MODULE__{data: data, type: {:u, 8}}), do: :binary.bin_to_list(data)
  def to_list(%__MODULE__{data: data, type: {:u, 32}}), do: for(<<x::32-native <- data>>, do: x)

  # Encoding one element. Non-finite values are written as their bit patterns.
  defp encode(:infinity, {f, _} = type) when f in [:f, :bf], do: bits(type, 0x7F800000, 0x7C00, 0x7F80)
  defp encode(:neg_infinity, {f, _} = type) when f in [:f, :bf], do: bits(type, 0xFF800000, 0xFC00, 0xFF80)
  defp encode(:nan, {f, _} = type) when f in [:f, :bf], do: bits(type, 0x7FC00000, 0x7E00, 0x7FC0)
  defp encode(x, {:f, 32}) when is_number(x), do: <<x::float-32-native>>
  defp encode(x, {:f, 16}) when is_number(x), do: <<x::float-16-native>>
  defp encode(x, {:s, 32}) when is_integer(x) and x in -0x80000000..0x7FFFFFFF, do: <<x::signed-32-native>>
  defp encode(x, {:u, 8}) when is_integer(x) and x in 0..255, do: <<x::8>>
  defp encode(x, {:u, 32}) when is_integer(x) and x in 0..0xFFFFFFFF, do: <<x::32-native>>

  defp encode(x, {:bf, 16}) when is_number(x) do
    # bfloat16 is the top half of a float32, rounded to nearest even.
    <<u::32>> = <<x::float-32>>
    rounded = Bitwise.bsr(u + 0x7FFF + Bitwise.band(Bitwise.bsr(u, 16), 1), 16)
    <<rounded::16-native>>
  end

  defp encode(x, type),
    do: raise(ArgumentError, "from_list/3: #{inspect(x)} is not a value of type #{inspect(type)}")

  defp bits({:f, 32}, b, _, _), do: <<b::32-native>>
  defp bits({:f, 16}, _, b, _), do: <<b::16-native>>
  defp bits({:bf, 16}, _, _, b), do: <<b::16-native>>

  # Decoding: the float patterns fail to match infinities and NaNs; those fall through to bits.
  defp f32(<<x::float-32-native>>), do: x
  defp f32(<<b::32-native>>), do: special(Bitwise.band(b, 0x7FFFFF) != 0, b >= 0x80000000)

  defp f16(<<x::float-16-native>>), do: x
  defp f16(<<b::16-native>>), do: special(Bitwise.band(b, 0x3FF) != 0, b >= 0x8000)

  defp bf16(<<b::16-native>>) do
    case <<b::16, 0::16>> do
      <<x::float-32>> -> x
      _ -> special(Bitwise.band(b, 0x7F) != 0, b >= 0x8000)
    end
  end

  defp special(true = _nan?, _negative?), do: :nan
  defp special(false, true), do: :neg_infinity
  defp special(false, false), do: :infinity
end
