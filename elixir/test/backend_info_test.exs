defmodule FlashNif.BackendInfoTest do
  # cuda_available?/0 and backend_info/0, the helpers ExPhil's own module offered, built from
  # info/0. Not async: one test swaps the NIF's load status for the whole VM.
  use ExUnit.Case, async: false

  alias ExPhil.Native.FlashAttention, as: FA

  test "info/0 names the GPU kernels last run per pass (nil before any)" do
    {:ok, %{last_kernels: %{forward: fwd, backward: bwd}}} = FA.info()

    for k <- [fwd, bwd] do
      assert Map.keys(k) |> Enum.sort() == [:kernel, :math, :not_sm90_because]
      assert is_nil(k.math) or k.math in ["3xf16", "3xtf32", "1xf16", "tf32", "f32-simt", "f16", "bf16"]
      assert is_nil(k.kernel) or is_binary(k.kernel)
    end
  end

  test "cuda_available?/0 is a boolean that agrees with info/0" do
    {:ok, %{backends: backends}} = FA.info()
    assert FA.cuda_available?() == :cuda in backends
  end

  test "backend_info/0 names the backend :auto picks, the version and the backends" do
    {:ok, %{version: version}} = FA.info()
    summary = FA.backend_info()
    assert is_binary(summary) and summary =~ "flash_nif #{version}"

    if FA.cuda_available?() do
      assert summary == "cuda (flash_nif #{version}; backends: cpu, cuda)"
    else
      assert summary == "cpu (flash_nif #{version}; backends: cpu; no usable CUDA GPU)"
    end
  end

  test "without the NIF: cuda_available?/0 is false and backend_info/0 says why" do
    key = {ExPhil.Native.FlashAttention.Nif, :status}
    saved = :persistent_term.get(key)

    try do
      :persistent_term.put(key, {:error, "the flash_nif NIF library is missing (a test)"})
      refute FA.cuda_available?()
      assert FA.backend_info() == "unavailable (the flash_nif NIF library is missing (a test))"
    after
      :persistent_term.put(key, saved)
    end
  end
end
