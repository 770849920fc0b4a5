defmodule FlashNif.ModifiersTest do
  # Score modifiers from Elixir (:softcap, :alibi_slopes, :sinks) beyond what the oracle fixtures
  # check (test/oracle_fixtures_test.exs): bad values as {:error, {kind, message}}, the result forms
  # (dsinks, the ! variants), Nx tensors as modifier arguments (test/support/fake_nx.ex when no real
  # Nx is present), nil as leaving an option out, and dsinks against finite differences.
  use ExUnit.Case, async: true

  alias ExPhil.Native.FlashAttention, as: FA
  alias ExPhil.Native.FlashAttention.{Error, Tensor}
  alias FlashNif.Numeric

  defp f32(list, shape), do: Tensor.from_list(list, shape, {:f, 32})
  defp s32(list, shape), do: Tensor.from_list(list, shape, {:s, 32})
  defp to_nx(%Tensor{data: d, shape: s, type: t}), do: d |> Nx.from_binary(t) |> Nx.reshape(s)
  # A float32 tensor from raw bit patterns (NaN and infinities, which from_list does not take).
  defp f32_bits(bits, shape),
    do: %Tensor{data: for(b <- bits, into: <<>>, do: <<b::32-native>>), shape: shape, type: {:f, 32}}

  @nan 0x7FC00000
  @inf 0x7F800000

  setup_all do
    # batch 2, seq_q 6, seq_k 9, heads 4, kv_heads 2, head_dim 8
    q = Numeric.random({2, 6, 4, 8}, {:f, 32}, 41)
    k = Numeric.random({2, 9, 2, 8}, {:f, 32}, 42)
    v = Numeric.random({2, 9, 2, 8}, {:f, 32}, 43)
    d_out = Numeric.random({2, 6, 4, 8}, {:f, 32}, 44)
    slopes = f32([0.5, 0.25, 0.125, 0.0625], {4})
    sinks = f32([0.3, -1.0, 2.0, 0.0], {4})
    mods = [softcap: 1.5, alibi_slopes: slopes, sinks: sinks]
    {:ok, o, lse} = FA.forward_with_states(q, k, v, mods)
    {:ok, q: q, k: k, v: v, d_out: d_out, slopes: slopes, sinks: sinks, mods: mods, o: o, lse: lse}
  end

  # Runs the call in a separate process that must exit normally with {:error, {kind, message}}.
  defp error_of(fun) do
    assert {:error, {kind, message}} = fun |> Task.async() |> Task.await()
    assert is_atom(kind) and is_binary(message) and message != ""
    {kind, message}
  end

  # The error of a bad option, which forward and backward must both give.
  defp every_call_error(ctx, opts) do
    %{q: q, k: k, v: v, d_out: d_out, o: o, lse: lse} = ctx
    padded = [fn -> FA.forward(q, k, v, opts) end, fn -> FA.backward(d_out, q, k, v, o, lse, opts) end]
    [first | rest] = Enum.map(padded, &error_of/1)
    for e <- rest, do: assert(e == first, "#{inspect(opts)}: #{inspect(e)} != #{inspect(first)}")
    first
  end

  describe "errors" do
    test "softcap: zero, negative, not finite in float32, or not a number is :unsupported", ctx do
      # Past 1e30 (or below 1e-30) c * log2(e) or its reciprocal would overflow float32 in the
      # kernels: a softcap of 3e38 gave NaN before the core refused it.
      for c <- [0, 0.0, -0.0, -1.5, -2, 1.0e-50, 1.0e-31, 1.0e31, 3.0e38, 1.0e300] do
        assert {:unsupported, msg} = every_call_error(ctx, softcap: c)
        assert msg =~ "softcap must be a finite positive number"
      end

      for c <- ["1.5", :infinity, true, {1.5}, 10 ** 400] do
        assert {:unsupported, msg} = every_call_error(ctx, softcap: c)
        assert msg == "the :softcap option must be a positive number or nil, got: #{inspect(c)}"
      end
    end

    test "alibi_slopes of the wrong shape is :shape, naming both accepted shapes", ctx do
      for shape <- [{3}, {3, 4}, {2, 3}, {4, 2}, {1, 4}, {2, 4, 1}, {}] do
        slopes = f32(List.duplicate(0.5, Tensor.size(shape)), shape)
        assert {:shape, msg} = every_call_error(ctx, alibi_slopes: slopes)
        assert msg =~ "alibi_slopes has shape #{inspect(Tuple.to_list(shape))}"
        assert msg =~ "expected [H] or [B, H] = [4] or [2, 4]"
      end

      short = %{ctx.slopes | data: binary_part(ctx.slopes.data, 0, 12)}
      assert {:shape, msg} = every_call_error(ctx, alibi_slopes: short)
      assert msg =~ "alibi_slopes has 3 values; its shape [4] needs 4"
    end

    test "sinks of the wrong shape is :shape", ctx do
      for shape <- [{3}, {2, 4}, {1}, {}] do
        sinks = f32(List.duplicate(0.5, Tensor.size(shape)), shape)
        assert {:shape, msg} = every_call_error(ctx, sinks: sinks)
        assert msg =~ "sinks has shape #{inspect(Tuple.to_list(shape))}; expected [H] = [4]"
      end
    end

    test "modifier tensors that are not float32 are :dtype", ctx do
      half = Tensor.from_list([0.3, -1.0, 2.0, 0.0], {4}, {:f, 16})
      assert {:dtype, "sinks has dtype float16; it must be float32"} = every_call_error(ctx, sinks: half)
      bf = Tensor.from_list([0.3, -1.0, 2.0, 0.0], {4}, {:bf, 16})

      assert {:dtype, "alibi_slopes has dtype bfloat16; it must be float32"} =
               every_call_error(ctx, alibi_slopes: bf)

      ints = s32([0, 1, 2, 3], {4})
      assert {:dtype, "sinks has dtype int32; it must be float32"} = every_call_error(ctx, sinks: ints)
      f64 = %Tensor{data: :binary.copy(<<0.5::float-64-native>>, 4), shape: {4}, type: {:f, 64}}
      assert {:dtype, "sinks has dtype {:f, 64}; it must be float32"} = every_call_error(ctx, sinks: f64)
    end

    test "NaN or infinite sinks and slopes are :unsupported", ctx do
      one = 0x3F800000

      for bad <- [@nan, @inf, @inf + 0x80000000] do
        assert {:unsupported, msg} = every_call_error(ctx, sinks: f32_bits([one, bad, one, one], {4}))
        assert msg =~ "sinks must be finite"
        assert {:unsupported, msg} = every_call_error(ctx, alibi_slopes: f32_bits([one, one, one, bad], {4}))
        assert msg =~ "alibi_slopes must be finite"
      end
    end

    test "sinks and slopes past 1e30 in magnitude are :unsupported (they gave NaN)", ctx do
      for x <- [3.0e38, -3.0e38, 2.0e30] do
        big = f32([0.5, x, 0.5, 0.5], {4})
        assert {:unsupported, msg} = every_call_error(ctx, sinks: big)
        assert msg =~ "sinks must be at most 1e30 in magnitude"
        assert {:unsupported, msg} = every_call_error(ctx, alibi_slopes: big)
        assert msg =~ "alibi_slopes must be at most 1e30 in magnitude"
      end

      edge = f32([1.0e30, -1.0e30, 0.5, 0.5], {4})
      {:ok, o} = FA.forward(ctx.q, ctx.k, ctx.v, sinks: edge, alibi_slopes: edge, softcap: 1.0e30)
      assert Enum.all?(Tensor.to_list(o), &is_float/1)
    end

    test "modifier arguments that are not tensors are :argument", ctx do
      assert {:argument, msg} = every_call_error(ctx, sinks: [0.3, -1.0, 2.0, 0.0])
      assert msg =~ "sinks must be an ExPhil.Native.FlashAttention.Tensor or an Nx.Tensor"
      assert {:argument, msg} = every_call_error(ctx, alibi_slopes: 0.5)
      assert msg =~ "alibi_slopes must be an ExPhil.Native.FlashAttention.Tensor or an Nx.Tensor"
      assert {:argument, msg} = every_call_error(ctx, sinks: %{ctx.sinks | data: [1, 2]})
      assert msg =~ "sinks.data must be a binary"
    end

    test "varlen calls check them too: {batch, heads} slopes count sequences" do
      q = Numeric.random({7, 4, 8}, {:f, 32}, 51)
      k = Numeric.random({10, 2, 8}, {:f, 32}, 52)
      {cu_q, cu_k} = {s32([0, 2, 2, 7], {4}), s32([0, 4, 5, 10], {4})}
      lse = f32(List.duplicate(0.0, 28), {4, 7})
      call = fn opts -> FA.varlen_forward(q, k, k, cu_q, cu_k, opts) end
      back = fn opts -> FA.varlen_backward(q, q, k, k, q, lse, cu_q, cu_k, opts) end

      slopes = f32(List.duplicate(0.5, 8), {2, 4})
      assert {:shape, msg} = error_of(fn -> call.(alibi_slopes: slopes) end)
      assert msg =~ "expected [H] or [B, H] = [4] or [3, 4]"
      assert {:shape, ^msg} = error_of(fn -> back.(alibi_slopes: slopes) end)
      assert {:unsupported, msg} = error_of(fn -> call.(softcap: -1.0) end)
      assert msg =~ "softcap"
      assert {:dtype, _} = error_of(fn -> back.(sinks: s32([0, 0, 0, 0], {4})) end)
      assert {:ok, _} = call.(alibi_slopes: f32(List.duplicate(0.5, 12), {3, 4}))
    end

    test "the ! variants raise with the kind", ctx do
      %{q: q, k: k, v: v, d_out: d_out, o: o, lse: lse} = ctx
      error = assert_raise Error, fn -> FA.forward!(q, k, v, softcap: -1) end
      assert error.kind == :unsupported and Exception.message(error) =~ "softcap"

      assert_raise Error, ~r/\(shape\) sinks has shape/, fn ->
        FA.backward!(d_out, q, k, v, o, lse, sinks: f32([1.0], {1}))
      end
    end
  end

  describe "results" do
    test "with sinks the backward adds dsinks, {heads} float32, whatever q's type; ! gives a 4-tuple", ctx do
      %{q: q, k: k, v: v, d_out: d_out, o: o, lse: lse, mods: mods} = ctx
      assert {:ok, dq, dk, dv, dsinks} = FA.backward(d_out, q, k, v, o, lse, mods)
      assert {dq.shape, dk.shape, dv.shape} == {q.shape, k.shape, v.shape}
      assert dsinks.type == {:f, 32} and dsinks.shape == {4}
      assert Enum.all?(Tensor.to_list(dsinks), &is_float/1)
      assert FA.backward!(d_out, q, k, v, o, lse, mods) == {dq, dk, dv, dsinks}

      # without sinks: three gradients
      no_sinks = Keyword.delete(mods, :sinks)
      {o2, lse2} = FA.forward_with_states!(q, k, v, no_sinks)
      assert {%Tensor{}, %Tensor{}, %Tensor{}} = FA.backward!(d_out, q, k, v, o2, lse2, no_sinks)

      bf = fn %Tensor{} = t -> Tensor.from_list(Tensor.to_list(t), t.shape, {:bf, 16}) end
      {bo, blse} = FA.forward_with_states!(bf.(q), bf.(k), bf.(v), mods)
      assert {bdq, _, _, bdsinks} = FA.backward!(bf.(d_out), bf.(q), bf.(k), bf.(v), bo, blse, mods)
      assert bdq.type == {:bf, 16} and bdsinks.type == {:f, 32} and bdsinks.shape == {4}
    end

    test "varlen: the packed call of one sequence per batch row equals the padded call, dsinks included",
         ctx do
      %{q: q, k: k, v: v, d_out: d_out, slopes: slopes} = ctx
      # The padded call with {batch, heads} slopes, and the same as two packed sequences.
      mods = [
        softcap: 1.5,
        alibi_slopes: f32(Tensor.to_list(slopes) ++ [0.9, 0.1, 0.3, 0.7], {2, 4}),
        sinks: ctx.sinks
      ]

      packed = fn %Tensor{shape: {b, s, h, d}} = t -> %{t | shape: {b * s, h, d}} end
      {cu_q, cu_k} = {s32([0, 6, 12], {3}), s32([0, 9, 18], {3})}

      {o, lse} = FA.forward_with_states!(q, k, v, mods)
      {vo, vlse} = FA.varlen_forward_with_states!(packed.(q), packed.(k), packed.(v), cu_q, cu_k, mods)
      assert close?(vo, packed.(o))
      # lse {batch, heads, seq_q} against {heads, total_q}
      assert close?(vlse, f32(transpose_lse(Tensor.to_list(lse), 2, 4, 6), {4, 12}))

      {dq, _dk, _dv, dsinks} = FA.backward!(d_out, q, k, v, o, lse, mods)

      {vdq, _, _, vdsinks} =
        FA.varlen_backward!(packed.(d_out), packed.(q), packed.(k), packed.(v), vo, vlse, cu_q, cu_k, mods)

      assert close?(vdq, packed.(dq)) and close?(vdsinks, dsinks)
    end

    test "nil modifiers are the same as leaving them out", ctx do
      %{q: q, k: k, v: v, d_out: d_out} = ctx
      nils = [softcap: nil, alibi_slopes: nil, sinks: nil]
      {:ok, o, lse} = FA.forward_with_states(q, k, v)
      assert {:ok, ^o, ^lse} = FA.forward_with_states(q, k, v, nils)
      {:ok, dq, dk, dv} = FA.backward(d_out, q, k, v, o, lse)
      assert {:ok, ^dq, ^dk, ^dv} = FA.backward(d_out, q, k, v, o, lse, nils)

      # one given, the others nil: the same as that one alone
      with_sinks = FA.forward_with_states(q, k, v, sinks: ctx.sinks)
      assert FA.forward_with_states(q, k, v, Keyword.put(nils, :sinks, ctx.sinks)) == with_sinks

      packed = fn %Tensor{shape: {b, s, h, d}} = t -> %{t | shape: {b * s, h, d}} end
      {cu_q, cu_k} = {s32([0, 6, 12], {3}), s32([0, 9, 18], {3})}
      plain = FA.varlen_forward_with_states(packed.(q), packed.(k), packed.(v), cu_q, cu_k)
      assert FA.varlen_forward_with_states(packed.(q), packed.(k), packed.(v), cu_q, cu_k, nils) == plain
    end

    test "an integer softcap is the float one; a huge softcap is no softcap", %{q: q, k: k, v: v} do
      assert FA.forward(q, k, v, softcap: 2) == FA.forward(q, k, v, softcap: 2.0)
      refute FA.forward(q, k, v, softcap: 2.0) == FA.forward(q, k, v)
      assert close?(FA.forward!(q, k, v, softcap: 1.0e6), FA.forward!(q, k, v))
    end

    test "{heads} slopes equal {batch, heads} slopes repeated", %{q: q, k: k, v: v, slopes: slopes} do
      repeated = f32(Tensor.to_list(slopes) ++ Tensor.to_list(slopes), {2, 4})

      assert FA.forward_with_states(q, k, v, alibi_slopes: slopes) ==
               FA.forward_with_states(q, k, v, alibi_slopes: repeated)

      refute FA.forward(q, k, v, alibi_slopes: slopes) == FA.forward(q, k, v)
    end

    test "a row that sees no key: output 0, logsumexp = its head's sink, no share of dsinks" do
      # Sq = 3 > Sk = 2, causal bottom-right: query 0 sees no key.
      q = Numeric.random({1, 3, 2, 4}, {:f, 32}, 61)
      k = Numeric.random({1, 2, 1, 4}, {:f, 32}, 62)
      d_out = Numeric.random({1, 3, 2, 4}, {:f, 32}, 63)
      sinks = f32([0.75, -1.25], {2})
      {o, lse} = FA.forward_with_states!(q, k, k, sinks: sinks)
      [[l00, _, _], [l10, _, _]] = lse |> Tensor.to_list() |> Enum.chunk_every(3)
      assert {l00, l10} == {0.75, -1.25}
      assert o |> Tensor.to_list() |> Enum.take(8) == List.duplicate(0.0, 8)

      # That row's d_out does not move dq, dk, dv or dsinks.
      {dq, dk, dv, dsinks} = FA.backward!(d_out, q, k, k, o, lse, sinks: sinks)

      zeroed =
        Tensor.from_list(List.duplicate(0.0, 8) ++ Enum.drop(Tensor.to_list(d_out), 8), d_out.shape, {:f, 32})

      {dq2, dk2, dv2, dsinks2} = FA.backward!(zeroed, q, k, k, o, lse, sinks: sinks)
      assert Enum.take(Tensor.to_list(dq), 8) == List.duplicate(0.0, 8)
      for {a, b} <- [{dq2, dq}, {dk2, dk}, {dv2, dv}, {dsinks2, dsinks}], do: assert(close?(a, b))
    end
  end

  describe "Nx tensors as modifier arguments" do
    test "give the same results as Tensor structs, whatever the form of q", ctx do
      %{q: q, k: k, v: v, d_out: d_out, mods: mods} = ctx
      nx_mods = [softcap: 1.5, alibi_slopes: to_nx(ctx.slopes), sinks: to_nx(ctx.sinks)]

      {:ok, o, lse} = FA.forward_with_states(q, k, v, mods)
      assert {:ok, ^o, ^lse} = FA.forward_with_states(q, k, v, nx_mods)
      {:ok, dq, dk, dv, dsinks} = FA.backward(d_out, q, k, v, o, lse, mods)
      assert {:ok, ^dq, ^dk, ^dv, ^dsinks} = FA.backward(d_out, q, k, v, o, lse, nx_mods)

      # Nx q: every result, dsinks included, is an Nx tensor with the same numbers.
      {:ok, nx_o, nx_lse} = FA.forward_with_states(to_nx(q), to_nx(k), to_nx(v), nx_mods)
      assert Nx.to_binary(nx_o) == o.data

      {:ok, _, _, _, nx_dsinks} = FA.backward(to_nx(d_out), to_nx(q), to_nx(k), to_nx(v), nx_o, nx_lse, mods)

      assert %Nx.Tensor{} = nx_dsinks
      assert Nx.shape(nx_dsinks) == {4} and Nx.type(nx_dsinks) == {:f, 32}
      assert Nx.to_binary(nx_dsinks) == dsinks.data
    end

    test "a vectorized one is an :argument error that names it", %{q: q, k: k, v: v, sinks: sinks} do
      vectorized =
        sinks.data |> :binary.copy(2) |> Nx.from_binary({:f, 32}) |> Nx.reshape({2, 4}) |> Nx.vectorize(:rows)

      assert {:error, {:argument, msg}} = FA.forward(q, k, v, sinks: vectorized)
      assert msg =~ "sinks is a vectorized Nx tensor"
    end
  end

  @h 1.0e-2

  describe "gradients" do
    # L = sum(o * w), so dL/do = w; dsinks, dq, dk and dv against central differences of forward/4
    # (f32, h = 1e-2: truncation and round-off both stay near 1e-4). Tiny sizes: every entry is checked.
    test "dsinks, dq, dk, dv match finite differences with softcap, {batch, heads} ALiBi and sinks" do
      q = Numeric.random({2, 3, 2, 4}, {:f, 32}, 71)
      k = Numeric.random({2, 4, 1, 4}, {:f, 32}, 72)
      v = Numeric.random({2, 4, 1, 4}, {:f, 32}, 73)
      w = Numeric.random({2, 3, 2, 4}, {:f, 32}, 74)
      slopes = f32([0.3, 0.8, 0.5, 0.1], {2, 2})
      sinks = f32([0.4, -0.6], {2})
      opts = fn sinks -> [causal: false, softcap: 1.2, alibi_slopes: slopes, sinks: sinks] end

      {o, lse} = FA.forward_with_states!(q, k, v, opts.(sinks))
      {dq, dk, dv, dsinks} = FA.backward!(w, q, k, v, o, lse, opts.(sinks))

      loss = fn q, k, v, sinks ->
        o = FA.forward!(q, k, v, opts.(sinks))
        Enum.zip(Tensor.to_list(o), Tensor.to_list(w)) |> Enum.reduce(0.0, fn {a, b}, s -> s + a * b end)
      end

      numeric = [
        dq: fd(q, &loss.(&1, k, v, sinks)),
        dk: fd(k, &loss.(q, &1, v, sinks)),
        dv: fd(v, &loss.(q, k, &1, sinks)),
        dsinks: fd(sinks, &loss.(q, k, v, &1))
      ]

      for {name, analytic} <- [dq: dq, dk: dk, dv: dv, dsinks: dsinks] do
        err = Numeric.rel_err(Tensor.to_list(analytic), numeric[name])
        assert err < 2.0e-3, "#{name}: relative error #{err} against finite differences"
      end
    end

    test "a gradient step on the sinks with dsinks lowers the loss (the README's training step)" do
      q = Numeric.random({1, 16, 2, 8}, {:f, 32}, 81)
      k = Numeric.random({1, 16, 2, 8}, {:f, 32}, 82)
      v = Numeric.random({1, 16, 2, 8}, {:f, 32}, 83)
      target = Numeric.random({1, 16, 2, 8}, {:f, 32}, 84)
      # loss = 0.5 * ||o - target||^2, so d_out = o - target
      loss_and_grad = fn sinks ->
        {o, lse} = FA.forward_with_states!(q, k, v, sinks: sinks)
        diff = Enum.zip_with(Tensor.to_list(o), Tensor.to_list(target), &(&1 - &2))
        d_out = f32(diff, o.shape)
        {_dq, _dk, _dv, dsinks} = FA.backward!(d_out, q, k, v, o, lse, sinks: sinks)
        {0.5 * Enum.reduce(diff, 0.0, &(&1 * &1 + &2)), dsinks}
      end

      sinks = f32([0.0, 0.0], {2})
      {loss0, dsinks} = loss_and_grad.(sinks)
      stepped = f32(Enum.zip_with(Tensor.to_list(sinks), Tensor.to_list(dsinks), &(&1 - 0.1 * &2)), {2})
      {loss1, _} = loss_and_grad.(stepped)
      assert Enum.any?(Tensor.to_list(dsinks), &(abs(&1) > 1.0e-3))
      assert loss1 < loss0
    end
  end

  # Central differences of f with respect to every element of x.
  defp fd(%Tensor{} = x, f) do
    values = Tensor.to_list(x)

    for i <- 0..(length(values) - 1) do
      plus = Tensor.from_list(List.update_at(values, i, &(&1 + @h)), x.shape, x.type)
      minus = Tensor.from_list(List.update_at(values, i, &(&1 - @h)), x.shape, x.type)
      (f.(plus) - f.(minus)) / (2 * @h)
    end
  end

  # lse {batch, heads, seq} as the flat list of {heads, batch * seq} (a varlen call's layout).
  defp transpose_lse(values, batch, heads, seq) do
    rows = Enum.chunk_every(values, seq)

    for h <- 0..(heads - 1), b <- 0..(batch - 1), x <- Enum.at(rows, b * heads + h), do: x
  end

  defp close?(a, b), do: Numeric.rel_err(a, b) < 1.0e-5
end
