defmodule FlashNif.PrecisionTest do
  # The :precision option reaches the core: :exact (default) and :tf32 are accepted by every call,
  # the CPU computes in f32 under either (bit-identical results), a bad value is :unsupported.
  # On a GPU (tagged :cuda) the f32 forward runs the split-TF32 kernel under :exact and the one-
  # product TF32 kernel under :tf32, within their bounds, and info/0 says which ran.
  use ExUnit.Case, async: true

  alias ExPhil.Native.FlashAttention, as: FA
  alias ExPhil.Native.FlashAttention.Tensor
  alias FlashNif.Numeric

  setup do
    q = Numeric.random({2, 37, 4, 16}, {:f, 32}, 21)
    k = Numeric.random({2, 37, 2, 16}, {:f, 32}, 22)
    v = Numeric.random({2, 37, 2, 16}, {:f, 32}, 23)
    d_out = Numeric.random({2, 37, 4, 16}, {:f, 32}, 24)
    %{q: q, k: k, v: v, d_out: d_out}
  end

  defp run(%{q: q, k: k, v: v, d_out: d_out}, opts) do
    {:ok, o, lse} = FA.forward_with_states(q, k, v, opts)
    {:ok, dq, dk, dv} = FA.backward(d_out, q, k, v, o, lse, opts)
    [o, lse, dq, dk, dv]
  end

  test "the CPU is exact f32 under either precision: identical bits", ctx do
    default = run(ctx, [])
    assert run(ctx, precision: :exact) == default
    assert run(ctx, precision: :tf32) == default
  end

  test "varlen calls take :precision" do
    cu = %Tensor{data: <<0::32-native, 20::32-native, 37::32-native>>, shape: {3}, type: {:s, 32}}
    [q, k, v] = for {h, seed} <- [{4, 31}, {2, 32}, {2, 33}], do: Numeric.random({37, h, 16}, {:f, 32}, seed)
    {:ok, a} = FA.varlen_forward(q, k, v, cu, cu, precision: :tf32)
    {:ok, b} = FA.varlen_forward(q, k, v, cu, cu)
    assert a == b
  end

  test "a bad precision is :unsupported, naming the choices", %{q: q, k: k, v: v} do
    for bad <- [:fast, "exact", nil, :fp32] do
      assert {:error, {:unsupported, msg}} = FA.forward(q, k, v, precision: bad)
      assert msg =~ "the :precision option must be :exact or :tf32"
    end
  end

  @tag :cuda
  test "on the GPU :exact runs split TF32 within f32's bound, :tf32 one TF32 product", %{q: q, k: k, v: v} do
    {:ok, cpu} = FA.forward(q, k, v, device: :cpu)
    {:ok, exact} = FA.forward(q, k, v, device: :cuda)
    {:ok, %{last_kernels: %{forward: ran}}} = FA.info()
    assert ran.math == "3xtf32" and ran.kernel =~ "tf32_terms3"
    assert Numeric.rel_err(exact, cpu) <= 1.0e-5

    {:ok, tf32} = FA.forward(q, k, v, device: :cuda, precision: :tf32)
    {:ok, %{last_kernels: %{forward: ran}}} = FA.info()
    assert ran.math == "tf32" and ran.kernel =~ "tf32_terms1"
    assert Numeric.rel_err(tf32, cpu) <= 5.0e-3
  end
end
