defmodule FlashNif.FlashAttentionTest do
  # API semantics: defaults, output forms, edge sizes, and the Nx path (through the stand-in of
  # test/support/fake_nx.ex when no real Nx is present).
  use ExUnit.Case, async: true
  doctest ExPhil.Native.FlashAttention

  alias ExPhil.Native.FlashAttention, as: FA
  alias ExPhil.Native.FlashAttention.Tensor
  alias FlashNif.Numeric

  setup_all do
    q = Numeric.random({2, 7, 4, 16}, {:f, 32}, 11)
    k = Numeric.random({2, 9, 2, 16}, {:f, 32}, 12)
    v = Numeric.random({2, 9, 2, 16}, {:f, 32}, 13)
    {:ok, q: q, k: k, v: v}
  end

  test "defaults: causal true, scale 1/sqrt(head_dim), device :cpu", %{q: q, k: k, v: v} do
    {:ok, o} = FA.forward(q, k, v)
    assert {:ok, ^o} = FA.forward(q, k, v, causal: true, scale: 0.25, device: :cpu)
    assert {:ok, ^o} = FA.forward(q, k, v, scale: nil)
    {:ok, full} = FA.forward(q, k, v, causal: false)
    refute full == o
    {:ok, other_scale} = FA.forward(q, k, v, scale: 0.5)
    refute other_scale == o
  end

  test "device: :cpu gives the CPU result", %{q: q, k: k, v: v} do
    {:ok, o, lse} = FA.forward_with_states(q, k, v, device: :cpu)
    assert {:ok, ^o} = FA.forward(q, k, v, device: :cpu)
    assert {:ok, _, _, _} = FA.backward(o, q, k, v, o, lse, device: :cpu)
  end

  test "integer scales are accepted", %{q: q, k: k, v: v} do
    assert FA.forward(q, k, v, scale: 1) == FA.forward(q, k, v, scale: 1.0)
  end

  test "forward/4 is forward_with_states/4 without the states", %{q: q, k: k, v: v} do
    {:ok, o, lse} = FA.forward_with_states(q, k, v, causal: false)
    assert {:ok, ^o} = FA.forward(q, k, v, causal: false)
    assert lse.shape == {2, 4, 7} and lse.type == {:f, 32}
  end

  test "inputs may be sub-binaries at any byte offset (unaligned)", %{q: q, k: k, v: v} do
    shifted = fn %Tensor{data: d} = t -> %{t | data: binary_part(<<0, d::binary>>, 1, byte_size(d))} end
    assert FA.forward(shifted.(q), shifted.(k), shifted.(v)) == FA.forward(q, k, v)
  end

  test "a causal row that sees no key: output 0, logsumexp -inf, zero gradients" do
    # Sq = 3 > Sk = 2, bottom-right aligned: query 0 sees keys j <= 0 + (2 - 3), none.
    q = Numeric.random({1, 3, 1, 4}, {:f, 32}, 1)
    k = Numeric.random({1, 2, 1, 4}, {:f, 32}, 2)
    {:ok, o, lse} = FA.forward_with_states(q, k, k)
    [l0, l1, l2] = Tensor.to_list(lse)
    assert l0 == :neg_infinity and is_float(l1) and is_float(l2)
    assert Enum.take(Tensor.to_list(o), 4) == [0.0, 0.0, 0.0, 0.0]

    {:ok, dq, _dk, _dv} = FA.backward(Numeric.random({1, 3, 1, 4}, {:f, 32}, 3), q, k, k, o, lse)
    assert Enum.take(Tensor.to_list(dq), 4) == [0.0, 0.0, 0.0, 0.0]
    refute Enum.any?(Tensor.to_list(dq), &(&1 == :nan))
  end

  test "empty sizes: no keys, or no batch" do
    q = Numeric.random({1, 2, 2, 8}, {:f, 32}, 1)
    none = %Tensor{data: <<>>, shape: {1, 0, 2, 8}, type: {:f, 32}}
    {:ok, o, lse} = FA.forward_with_states(q, none, none, causal: false)
    assert Enum.all?(Tensor.to_list(o), &(&1 == 0.0))
    assert Enum.all?(Tensor.to_list(lse), &(&1 == :neg_infinity))

    empty = %Tensor{data: <<>>, shape: {0, 2, 2, 8}, type: {:f, 32}}
    assert {:ok, %Tensor{data: <<>>, shape: {0, 2, 2, 8}}} = FA.forward(empty, empty, empty)
  end

  test "f16 and bf16 in, same type out; logsumexp stays f32" do
    for type <- [{:f, 16}, {:bf, 16}] do
      q = Numeric.random({1, 5, 2, 8}, type, 1)
      k = Numeric.random({1, 6, 1, 8}, type, 2)
      {:ok, o, lse} = FA.forward_with_states(q, k, k)
      assert o.type == type and byte_size(o.data) == 5 * 2 * 8 * 2
      assert lse.type == {:f, 32}
      {:ok, dq, dk, dv} = FA.backward(o, q, k, k, o, lse)
      assert {dq.type, dk.type, dv.type} == {type, type, type}
      assert dk.shape == {1, 6, 1, 8}
    end
  end

  test "info/0 names the version and the backends" do
    assert {:ok, %{version: version, backends: backends}} = FA.info()
    assert version == to_string(Application.spec(:flash_nif, :vsn))
    assert :cpu in backends
  end

  describe "Nx interop" do
    # Nx cannot be installed here (hex.pm is unreachable): these run against the stand-in in
    # test/support/fake_nx.ex, which checks the plumbing; with a real Nx on the code path they run
    # against it (they pass with Nx 0.7.2, see the README's Nx section).
    defp to_nx(%Tensor{data: d, shape: s, type: t}), do: d |> Nx.from_binary(t) |> Nx.reshape(s)

    test "Nx tensors in, Nx tensors out, same numbers", %{q: q, k: k, v: v} do
      {:ok, o, lse} = FA.forward_with_states(q, k, v)
      {:ok, nx_o, nx_lse} = FA.forward_with_states(to_nx(q), to_nx(k), to_nx(v))
      assert %Nx.Tensor{} = nx_o
      assert Nx.shape(nx_o) == o.shape and Nx.type(nx_o) == {:f, 32}
      assert Nx.to_binary(nx_o) == o.data
      assert Nx.shape(nx_lse) == lse.shape and Nx.to_binary(nx_lse) == lse.data

      {:ok, dq, dk, dv} = FA.backward(o, q, k, v, o, lse)
      {:ok, nx_dq, nx_dk, nx_dv} = FA.backward(to_nx(o), to_nx(q), to_nx(k), to_nx(v), nx_o, nx_lse)
      assert {Nx.to_binary(nx_dq), Nx.to_binary(nx_dk), Nx.to_binary(nx_dv)} == {dq.data, dk.data, dv.data}
      assert Nx.shape(nx_dk) == k.shape
    end

    test "an Nx tensor that cannot be read is an :argument error", %{k: k, v: v} do
      broken = %Nx.Tensor{data: :no_data, shape: {1, 7, 4, 16}, type: {:f, 32}, names: [nil, nil, nil, nil]}
      assert {:error, {:argument, msg}} = FA.forward(broken, k, v)
      assert msg =~ "cannot read q with Nx.to_binary/1"
    end

    test "a vectorized Nx tensor is an :argument error that names it, whatever the size", ctx do
      %{q: q, k: k, v: v} = ctx
      {:ok, o, lse} = FA.forward_with_states(q, k, v)

      # size 1 used to run as if not vectorized, size 2 to fail on a byte count
      for size <- [1, 2] do
        vectorized =
          k.data
          |> :binary.copy(size)
          |> Nx.from_binary(k.type)
          |> Nx.reshape(Tuple.insert_at(k.shape, 0, size))
          |> Nx.vectorize(:rows)

        assert {:error, {:argument, msg}} = FA.forward(q, vectorized, v)
        assert msg =~ "k is a vectorized Nx tensor (vectorized axes [rows: #{size}])"
        assert {:error, {:argument, ^msg}} = FA.backward(o, q, vectorized, v, o, lse)
      end
    end

    test "results take the form of q; mixed inputs are fine", %{q: q, k: k, v: v} do
      assert {:ok, %Tensor{}} = FA.forward(q, to_nx(k), v)
      assert {:ok, %Nx.Tensor{}} = FA.forward(to_nx(q), k, to_nx(v))
    end
  end
end

defmodule FlashNif.TensorTest do
  use ExUnit.Case, async: true
  alias ExPhil.Native.FlashAttention.Tensor

  test "from_list/to_list round trips, with non-finite values" do
    values = [1.5, -2.25, 0.0, :infinity, :neg_infinity, :nan]

    for type <- [{:f, 32}, {:f, 16}, {:bf, 16}] do
      t = Tensor.from_list(values, {2, 3}, type)
      assert byte_size(t.data) == 6 * Tensor.byte_size(type)
      assert Tensor.to_list(t) == values
    end
  end

  test "bf16 rounds to nearest even" do
    # 1 + 2^-8 lies halfway between bf16 neighbours 1 and 1 + 2^-7: ties go to even (1.0).
    assert Tensor.to_list(Tensor.from_list([1 + 2 ** -8], {1}, {:bf, 16})) == [1.0]
    assert Tensor.to_list(Tensor.from_list([1 + 3 * 2 ** -8], {1}, {:bf, 16})) == [1 + 2 ** -6]
    assert Tensor.to_list(Tensor.from_list([1 + 2 ** -8 + 2 ** -12], {1}, {:bf, 16})) == [1 + 2 ** -7]
  end

  test "from_list checks the element count" do
    assert_raise ArgumentError, ~r/3 values for shape \{2, 2\}/, fn ->
      Tensor.from_list([1, 2, 3], {2, 2}, {:f, 32})
    end
  end
end
