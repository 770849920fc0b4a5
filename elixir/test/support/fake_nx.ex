# A stand-in for the few Nx functions ExPhil.Native.FlashAttention calls, so the Nx code path is
# exercised by the tests in an environment where Nx cannot be installed (hex.pm is unreachable).
# It mimics Nx's documented signatures; it does not prove compatibility with a real Nx release.
# Skipped when a real Nx is present.
unless Code.ensure_loaded?(Nx) do
  defmodule Nx.Tensor do
    @moduledoc false
    defstruct [:data, :type, :shape, names: [], vectorized_axes: []]
  end

  defmodule Nx do
    @moduledoc false
    def to_binary(%Nx.Tensor{data: {:fake_backend, bin}}), do: bin
    def shape(%Nx.Tensor{shape: shape}), do: shape
    def type(%Nx.Tensor{type: type}), do: type

    def from_binary(bin, type) when is_binary(bin) do
      {_, bits} = type
      %Nx.Tensor{data: {:fake_backend, bin}, type: type, shape: {div(byte_size(bin) * 8, bits)}}
    end

    def reshape(%Nx.Tensor{shape: old} = t, shape) do
      true = tuple_product(old) == tuple_product(shape)
      %{t | shape: shape}
    end

    # The leading axis becomes a vectorized axis.
    def vectorize(%Nx.Tensor{shape: shape, vectorized_axes: axes} = t, name) when is_atom(name) do
      [size | rest] = Tuple.to_list(shape)
      %{t | shape: List.to_tuple(rest), vectorized_axes: axes ++ [{name, size}]}
    end

    defp tuple_product(shape), do: shape |> Tuple.to_list() |> Enum.reduce(1, &(&1 * &2))
  end
end
