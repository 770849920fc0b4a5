defmodule FlashNif.RotaryFixtures do
  @moduledoc false
  # Reads tests/fixtures/rotary/ (written by tests/fixtures/generate_rotary.py from the float64
  # oracle; tests/test_rotary.py checks the Python side against the same files): every case with
  # its tensors as ExPhil.Native.FlashAttention.Tensor structs.

  @dir Path.expand("../../../tests/fixtures/rotary", __DIR__)

  @doc """
  All cases: maps with :name, :dtype, :batch, :seq, :heads, :head_dim, :rotary_dim, :max_pos,
  :interleaved, :offset (nil when the case passes its positions tensor), :tol (%{"y", "dx"}
  keys as atoms), :tensors (x, dy, cos, sin, positions?, y, dx) and :opts (the call's options).
  """
  def cases, do: for(c <- FlashNif.Fixtures.manifest(@dir), do: load(c))

  defp load(c) do
    tensors = FlashNif.Fixtures.tensors(@dir, c)
    positions = if c.offset == nil, do: tensors.positions, else: c.offset
    %{c | tensors: tensors} |> Map.put(:opts, interleaved: c.interleaved, positions: positions)
  end
end
