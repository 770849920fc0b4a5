defmodule FlashNif.DecodeFixtures do
  @moduledoc false
  # Reads tests/fixtures/decode/ (written by tests/fixtures/generate_decode.py from the float64
  # oracle; tests/test_decode_fixtures.py checks the Python side against the same files): every
  # case with its tensors as ExPhil.Native.FlashAttention.Tensor structs.

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
  def manifest, do: FlashNif.Fixtures.manifest(@dir)

  defp load(c), do: %{c | tensors: FlashNif.Fixtures.tensors(@dir, c)}
end
