defmodule FlashNif.RotaryFixtures do
  @moduledoc false
  # Reads tests/fixtures/rotary/ (written by tests/fixtures/generate_rotary.py from the float64
  # oracle; tests/test_rotary.py checks the Python side against the same files): every case with
  # its tensors as ExPhil.Native.FlashAttention.Tensor structs.

  alias ExPhil.Native.FlashAttention.Tensor

  @dir Path.expand("../../../tests/fixtures/rotary", __DIR__)

  @doc """
  All cases: maps with :name, :dtype, :batch, :seq, :heads, :head_dim, :rotary_dim, :max_pos,
  :interleaved, :offset (nil when the case passes its positions tensor), :tol (%{"y", "dx"}
  keys as atoms), :tensors (x, dy, cos, sin, positions?, y, dx) and :opts (the call's options).
  """
  def cases do
    {:ok, terms} = :file.consult(String.to_charlist(Path.join(@dir, "manifest.eterm")))
    {:header, %{byte_order: "little"}} = hd(terms)
    for {:fixture, c} <- terms, do: load(c)
  end

  defp load(c) do
    blob = File.read!(Path.join(@dir, c.file))

    tensors =
      Map.new(c.tensors, fn t ->
        type = FlashNif.Fixtures.type(t.dtype)
        size = Tensor.byte_size(type)

        data =
          for <<x::little-size(size * 8) <- binary_part(blob, t.offset, t.nbytes)>>,
            into: <<>>,
            do: <<x::native-size(size * 8)>>

        {String.to_atom(t.name), %Tensor{data: data, shape: List.to_tuple(t.shape), type: type}}
      end)

    positions = if c.offset == nil, do: tensors.positions, else: c.offset
    %{c | tensors: tensors} |> Map.put(:opts, interleaved: c.interleaved, positions: positions)
  end
end
