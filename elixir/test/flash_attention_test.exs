defmodule FlashNif.FlashAttentionTest do
  # API semantics: defaults, output forms, edge sizes, and the Nx path (through the stand-in of
  # test/support/fake_nx.ex when no real Nx is present).
  use ExUnit.Case, async: true
  doctest ExPhil.Native.FlashAttention

  alias ExPhil.Native.FlashAttention, as: FA
  alias ExPhil.Native.FlashAttention.Tensor
  alias FlashNif.Numeric

  defp to_nx(%Tensor{data: d, shape: s, type: t}), do: d |> Nx.from_binary(t) |> Nx.reshape(s)

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

  describe "masks" do
    # The oracle fixtures check each mask's numbers; these check how options are read.
    defp s32(list, shape), do: Tensor.from_list(list, shape, {:s, 32})
    defp close?(a, b), do: Numeric.rel_err(a, b) <= 1.0e-6

    test "window: {:infinity, :infinity} and nil masks are no mask at all", %{q: q, k: k, v: v} do
      {:ok, o, lse} = FA.forward_with_states(q, k, v)
      none = [window: nil, segment_ids: nil, seqused_k: nil, leftpad_k: nil, block_mask: nil]
      assert {:ok, ^o, ^lse} = FA.forward_with_states(q, k, v, window: {:infinity, :infinity})
      assert {:ok, ^o, ^lse} = FA.forward_with_states(q, k, v, none)
      assert FA.backward(o, q, k, v, o, lse, none) == FA.backward(o, q, k, v, o, lse)
    end

    test ":infinity is an unbounded side: {:infinity, 0} is the causal mask", %{q: q, k: k, v: v} do
      {:ok, causal} = FA.forward(q, k, v)
      {:ok, windowed} = FA.forward(q, k, v, causal: false, window: {:infinity, 0})
      assert close?(windowed, causal)
      {:ok, wide} = FA.forward(q, k, v, causal: false, window: {1_000_000, 1_000_000})
      {:ok, full} = FA.forward(q, k, v, causal: false)
      assert close?(wide, full)
      {:ok, narrow} = FA.forward(q, k, v, causal: false, window: {1, 0})
      refute close?(narrow, causal)
    end

    test "window: {0, 0} with Sq == Sk: every query sees its own key only, output = v" do
      v = Numeric.random({1, 6, 2, 8}, {:f, 32}, 21)
      q = Numeric.random({1, 6, 2, 8}, {:f, 32}, 22)
      {:ok, o} = FA.forward(q, q, v, causal: false, window: {0, 0})
      assert close?(o, v)
    end

    test "padding that covers every key is no padding; a short one changes the result", ctx do
      %{q: q, k: k, v: v} = ctx
      {:ok, o} = FA.forward(q, k, v)
      {:ok, padded} = FA.forward(q, k, v, seqused_k: s32([9, 9], {2}), leftpad_k: s32([0, 0], {2}))
      assert close?(padded, o)
      {:ok, short} = FA.forward(q, k, v, seqused_k: s32([9, 5], {2}))
      refute close?(short, o)
    end

    test "mask tensors may be Nx tensors, whatever the form of q", %{q: q, k: k, v: v} do
      seg_q = s32([0, 0, 0, 1, 1, 1, 1, 0, 1, 1, 1, 1, 1, 1], {2, 7})
      seg_k = s32([0, 0, 0, 0, 1, 1, 1, 1, 1, 0, 0, 1, 1, 1, 1, 1, 1, 1], {2, 9})
      bm = Tensor.from_list([1, 0, 1, 1], {1, 4, 1, 1}, {:u, 8})
      opts = [segment_ids: {seg_q, seg_k}, block_mask: bm, seqused_k: s32([9, 8], {2})]

      nx_opts = [
        segment_ids: {to_nx(seg_q), to_nx(seg_k)},
        block_mask: to_nx(bm),
        seqused_k: to_nx(s32([9, 8], {2}))
      ]

      {:ok, o, lse} = FA.forward_with_states(q, k, v, opts)
      assert {:ok, ^o, ^lse} = FA.forward_with_states(q, k, v, nx_opts)
      {:ok, nx_o} = FA.forward(to_nx(q), to_nx(k), to_nx(v), nx_opts)
      assert Nx.to_binary(nx_o) == o.data
      assert FA.backward(o, q, k, v, o, lse, nx_opts) == FA.backward(o, q, k, v, o, lse, opts)
    end

    test "varlen: one sequence is the padded call of batch 1; lse is {heads, total_q}" do
      q = Numeric.random({1, 7, 4, 16}, {:f, 32}, 31)
      k = Numeric.random({1, 9, 2, 16}, {:f, 32}, 32)
      d_out = Numeric.random({1, 7, 4, 16}, {:f, 32}, 33)
      packed = fn %Tensor{shape: {1, s, h, d}} = t -> %{t | shape: {s, h, d}} end
      {cu_q, cu_k} = {s32([0, 7], {2}), s32([0, 9], {2})}

      {:ok, o, lse} = FA.forward_with_states(q, k, k, window: {3, :infinity})

      {:ok, vo, vlse} =
        FA.varlen_forward_with_states(packed.(q), packed.(k), packed.(k), cu_q, cu_k, window: {3, :infinity})

      assert vo.shape == {7, 4, 16} and vlse.shape == {4, 7}
      assert close?(vo, packed.(o)) and close?(vlse, %{lse | shape: {4, 7}})

      assert {:ok, ^vo} =
               FA.varlen_forward(packed.(q), packed.(k), packed.(k), cu_q, cu_k, window: {3, :infinity})

      {:ok, dq, dk, _} = FA.backward(d_out, q, k, k, o, lse, window: {3, :infinity})

      {:ok, vdq, vdk, vdv} =
        FA.varlen_backward(packed.(d_out), packed.(q), packed.(k), packed.(k), vo, vlse, cu_q, cu_k,
          window: {3, :infinity}
        )

      assert close?(vdq, packed.(dq)) and close?(vdk, packed.(dk)) and vdv.shape == {9, 2, 16}

      assert {^vo, ^vlse} =
               FA.varlen_forward_with_states!(packed.(q), packed.(k), packed.(k), cu_q, cu_k,
                 window: {3, :infinity}
               )
    end
  end

  describe "Nx interop" do
    # Nx cannot be installed here (hex.pm is unreachable): these run against the stand-in in
    # test/support/fake_nx.ex, which checks the plumbing; with a real Nx on the code path they run
    # against it (they pass with Nx 0.7.2, see the README's Nx section).

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
