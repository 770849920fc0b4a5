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

  @doc """
  `t` `{batch, seq, ...}` with `update` `{batch, n, ...}` (same type and trailing dims) written
  at sequence positions `start .. start + n - 1` of every batch row; `start` is an integer, or a
  list with one start per batch row. Appending a decode step's keys or values to a preallocated
  cache, without Nx (`Nx.put_slice/3` does it for Nx tensors). It copies `t` (binaries are
  immutable). Raises `ArgumentError` on mismatched shapes or types, or rows past `seq`.

      iex> alias ExPhil.Native.FlashAttention.Tensor
      iex> cache = Tensor.from_list([1, 2, 0, 3, 4, 0], {2, 3}, {:s, 32})
      iex> new = Tensor.from_list([5, 6], {2, 1}, {:s, 32})
      iex> Tensor.put_seq(cache, [2, 1], new) |> Tensor.to_list()
      [1, 2, 5, 3, 6, 0]
  """
  @spec put_seq(t, non_neg_integer | [non_neg_integer], t) :: t
  def put_seq(
        %__MODULE__{shape: shape, type: type} = t,
        start,
        %__MODULE__{shape: ushape, type: type} = update
      )
      when tuple_size(shape) >= 2 and tuple_size(ushape) == tuple_size(shape) and
             elem(shape, 0) == elem(ushape, 0) do
    [b, s | rest] = Tuple.to_list(shape)
    [_, n | urest] = Tuple.to_list(ushape)
    starts = if is_integer(start), do: List.duplicate(start, b), else: start

    unless rest == urest and is_list(starts) and length(starts) == b and
             Enum.all?(starts, &(is_integer(&1) and &1 >= 0 and &1 + n <= s)) do
      raise ArgumentError,
            "put_seq/3: cannot write #{inspect(ushape)} into #{inspect(shape)} at #{inspect(start)}"
    end

    inner = Enum.reduce(rest, __MODULE__.byte_size(type), &(&1 * &2))
    {row, urow} = {s * inner, n * inner}

    data =
      for {st, i} <- Enum.with_index(starts) do
        at = i * row

        [
          binary_part(t.data, at, st * inner),
          binary_part(update.data, i * urow, urow),
          binary_part(t.data, at + (st + n) * inner, (s - st - n) * inner)
        ]
      end

    %{t | data: IO.iodata_to_binary(data)}
  end

  def put_seq(t, start, update) do
    raise ArgumentError,
          "put_seq/3: cannot write #{inspect(shape_and_type(update))} into #{inspect(shape_and_type(t))} " <>
            "at #{inspect(start)}: both must be tensors {batch, seq, ...} of one type and batch"
  end

  defp shape_and_type(%__MODULE__{shape: shape, type: type}), do: {shape, type}
  defp shape_and_type(other), do: other

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
