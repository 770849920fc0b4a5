defmodule FlashNif.DecodeFixtures do
  @moduledoc false
  # Reads tests/fixtures/decode/ (written by tests/fixtures/generate_decode.py from the float64
  # oracle; tests/test_decode_fixtures.py checks the Python side against the same files): every
  # case with its tensors as ExPhil.Native.FlashAttention.Tensor structs.

  alias ExPhil.Native.FlashAttention.Tensor

  @dir Path.expand("../../../tests/fixtures/decode", __DIR__)

  @doc """
  All cases: the manifest's maps (:name, :kind ("quantize", "decode" or "merge"), :dtype, sizes,
  options, :tol with atom keys) with :tensors, a map of Tensor structs by atom name.
  """
  def cases, do: Enum.map(manifest(), &load/1)

  @doc "One case by name, its tensors loaded."
  def case!(name), do: manifest() |> Enum.find(&(&1.name == name)) |> load()

  @doc """
  The manifest alone, tensors as their descriptions: for generating tests at compile time
  without putting megabytes of fixtures into the test module as literals.
  """
  def manifest do
    {:ok, terms} = :file.consult(String.to_charlist(Path.join(@dir, "manifest.eterm")))
    {:header, %{byte_order: "little"}} = hd(terms)
    for {:fixture, c} <- terms, do: c
  end

  defp load(c) do
    blob = File.read!(Path.join(@dir, c.file))

    tensors =
      Map.new(c.tensors, fn t ->
        type = FlashNif.Fixtures.type(t.dtype)
        size = Tensor.byte_size(type) * 8

        data = little_to_native(binary_part(blob, t.offset, t.nbytes), size)

        {String.to_atom(t.name), %Tensor{data: data, shape: List.to_tuple(t.shape), type: type}}
      end)

    %{c | tensors: tensors}
  end

  defp little_to_native(bin, size) do
    case :erlang.system_info(:endian) do
      :little -> bin
      :big -> for <<x::little-size(size) <- bin>>, into: <<>>, do: <<x::big-size(size)>>
    end
  end
end
