defmodule FlashNif.ModeTest do
  # The :mode option reaches the core: fused and materialized agree (forward and backward, padded
  # and varlen), a bad value is :unsupported, and an explicit :materialized whose score matrices
  # would pass the default ceiling (1 GiB) is refused before any work. (FLASH_NIF_MODE and
  # FLASH_NIF_MATERIALIZE_MAX_BYTES are read by the native library from the process environment,
  # which System.put_env does not change: they are set before the VM starts.)
  use ExUnit.Case, async: true

  alias ExPhil.Native.FlashAttention, as: FA
  alias ExPhil.Native.FlashAttention.Tensor
  alias FlashNif.Numeric

  setup do
    q = Numeric.random({2, 60, 4, 16}, {:f, 32}, 11)
    k = Numeric.random({2, 60, 2, 16}, {:f, 32}, 12)
    v = Numeric.random({2, 60, 2, 16}, {:f, 32}, 13)
    d_out = Numeric.random({2, 60, 4, 16}, {:f, 32}, 14)
    %{q: q, k: k, v: v, d_out: d_out}
  end

  defp run(%{q: q, k: k, v: v, d_out: d_out}, opts) do
    {:ok, o, lse} = FA.forward_with_states(q, k, v, opts)
    {:ok, dq, dk, dv} = FA.backward(d_out, q, k, v, o, lse, opts)
    [o, lse, dq, dk, dv]
  end

  test "fused and materialized agree, forward and backward", ctx do
    for opts <- [[causal: true], [causal: true, window: {20, 0}], [causal: false]] do
      fused = run(ctx, [{:mode, :fused} | opts])
      materialized = run(ctx, [{:mode, :materialized} | opts])
      auto = run(ctx, opts)

      for {f, m, a} <- Enum.zip([fused, materialized, auto]) do
        assert Numeric.rel_err(m, f) <= 1.0e-5
        assert Numeric.rel_err(a, f) <= 1.0e-5
      end
    end
  end

  test "varlen calls take :mode", %{q: q, k: k, v: v} do
    [q, k, v] = for t <- [q, k, v], do: %Tensor{t | shape: Tuple.delete_at(put_elem(t.shape, 1, 120), 0)}
    cu = Tensor.from_list([0, 50, 120], {3}, {:s, 32})
    {:ok, f} = FA.varlen_forward(q, k, v, cu, cu, mode: :fused)
    {:ok, m} = FA.varlen_forward(q, k, v, cu, cu, mode: :materialized)
    assert Numeric.rel_err(m, f) <= 1.0e-5
  end

  test "bad values and the ceiling", %{q: q, k: k, v: v} do
    assert {:error, {:unsupported, msg}} = FA.forward(q, k, v, mode: :fast)
    assert msg =~ "the :mode option must be :auto, :fused or :materialized"

    # seq 17000: one head's 17000 x 17024 f32 scores alone are 1.08 GiB.
    long = Numeric.random({1, 17_000, 1, 4}, {:f, 32}, 15)
    assert {:error, {:unsupported, msg}} = FA.forward(long, long, long, mode: :materialized)
    assert msg =~ "over the ceiling" and msg =~ "FLASH_NIF_MATERIALIZE_MAX_BYTES"
  end
end
