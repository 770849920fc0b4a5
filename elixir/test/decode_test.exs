defmodule FlashNif.DecodeTest do
  # quantize_kv/2, dequantize_kv/1, merge_states/2 and decode/4: the float64 oracle's numbers in
  # tests/fixtures/decode (the fixtures tests/test_decode_fixtures.py checks Python against; the
  # cases of tests/test_quant.py), a decode loop appending to a preallocated cache, the forms of
  # the results, and the errors of tests/test_quant.py (never a crash).
  use ExUnit.Case, async: true
  # Tensor.put_seq/3's example (the decode functions' examples run with the module's doctests).
  doctest ExPhil.Native.FlashAttention.Tensor

  alias ExPhil.Native.FlashAttention, as: FA
  alias ExPhil.Native.FlashAttention.{Error, QuantizedKV, Tensor}
  alias FlashNif.{DecodeFixtures, Numeric}

  # Names and sizes at compile time, tensors loaded by each test (not module literals).
  @manifest DecodeFixtures.manifest()

  defp error_of(fun) do
    assert {:error, {kind, message}} = Task.await(Task.async(fun))
    {kind, message}
  end

  defp f32(list, shape), do: Tensor.from_list(list, shape, {:f, 32})
  defp s32(list, shape), do: Tensor.from_list(list, shape, {:s, 32})

  defp ones(shape, type \\ {:f, 32}),
    do: Tensor.from_list(List.duplicate(1.0, Tensor.size(shape)), shape, type)

  test "the fixtures cover every format and dtype, GQA, Sq 1 to 16, empty and padded rows, the options" do
    cases = DecodeFixtures.cases()
    decode = Enum.filter(cases, &(&1.kind == "decode"))
    quant = Enum.filter(cases, &(&1.kind == "quantize"))
    assert Enum.sort(Enum.map(quant, &{&1.bits, &1.group_size})) == [{4, 32}, {4, 64}, {8, 32}, {8, 64}]
    assert Enum.sort(Enum.uniq(Enum.map(quant, & &1.dtype))) == ["bfloat16", "float16", "float32"]
    assert Enum.sort(Enum.uniq(Enum.map(decode, & &1.quant))) == [nil, [4, 32], [4, 64], [8, 32]]
    assert Enum.sort(Enum.uniq(Enum.map(decode, & &1.seq_q))) == [1, 2, 4, 16]
    assert Enum.any?(decode, &(&1.heads == 8 * &1.kv_heads)) and Enum.any?(decode, &(&1.heads == &1.kv_heads))
    assert Enum.any?(decode, &(0 in Tensor.to_list(&1.tensors.cache_seqlens)))
    assert Enum.any?(decode, &Enum.any?(Tensor.to_list(&1.tensors.leftpad_k), fn p -> p > 0 end))
    assert Enum.any?(decode, &(not &1.causal and &1.window != nil))
    assert Enum.any?(decode, &(&1.softcap != nil and &1.scale != nil))
    assert Enum.any?(cases, &(&1.kind == "merge" and &1.dtype == "bfloat16"))
  end

  describe "quantize_kv and dequantize_kv" do
    for c <- Enum.filter(@manifest, &(&1.kind == "quantize")) do
      @tag fixture: c.name
      test "#{c.name}: the oracle's codes, scales and biases bit for bit; dequantized within rounding" do
        c = DecodeFixtures.case!(unquote(c.name))
        t = c.tensors
        assert {:ok, %QuantizedKV{} = q} = FA.quantize_kv(t.x, bits: c.bits, group_size: c.group_size)
        assert {q.shape, q.type, q.bits, q.group_size} == {t.x.shape, t.x.type, c.bits, c.group_size}
        assert q.values == t.values and q.scales == t.scales and q.biases == t.biases

        assert {:ok, deq} = FA.dequantize_kv(q)
        assert deq.shape == t.x.shape and deq.type == t.x.type

        got =
          deq |> Tensor.to_list() |> Enum.zip(Tensor.to_list(t.deq)) |> Enum.zip(Tensor.to_list(t.deq_tol))

        bad = Enum.reject(got, fn {{g, w}, tol} -> abs(g - w) <= tol end)

        assert bad == [],
               "#{c.name}: #{length(bad)} elements past their bound, e.g. #{inspect(Enum.take(bad, 3))}"
      end
    end

    test "the defaults are 4 bits in groups of 64, as in Python" do
      x = Numeric.random({1, 3, 2, 128}, {:f, 32}, 5)
      assert FA.quantize_kv(x) == FA.quantize_kv(x, bits: 4, group_size: 64)
      assert %QuantizedKV{bits: 4, group_size: 64} = FA.quantize_kv!(x)
      assert inspect(FA.quantize_kv!(x)) =~ "QuantizedKV<shape: {1, 3, 2, 128}, type: {:f, 32}, bits: 4"
    end

    test "QuantizedKV.new/5 derives the shape and type from the parts" do
      c = FA.quantize_kv!(Numeric.random({2, 3, 1, 64}, {:bf, 16}, 6), bits: 8, group_size: 32)
      assert QuantizedKV.new(c.values, c.scales, c.biases, 8, 32) == c
      assert {:ok, _} = FA.dequantize_kv(%{QuantizedKV.new(c.values, c.scales, c.biases, 8, 32) | shape: nil})
    end
  end

  describe "decode" do
    for c <- Enum.filter(@manifest, &(&1.kind == "decode")) do
      @tag fixture: c.name
      test "#{c.name}: matches the oracle with every num_splits" do
        check_decode(DecodeFixtures.case!(unquote(c.name)), device: :cpu)
      end

      # The GPU kernels through the NIF (host buffers copied to GPU 0 and back); test_helper.exs
      # leaves :cuda tests out where no GPU is usable.
      @tag fixture: c.name
      @tag :cuda
      test "#{c.name}: device: :cuda matches the oracle with every num_splits" do
        check_decode(DecodeFixtures.case!(unquote(c.name)), device: :cuda)
      end
    end

    test "a loop appending each token to a preallocated quantized cache is attention over its prefix" do
      {b, h, hkv, d, s_max} = {2, 4, 2, 64, 32}
      empty = Tensor.from_list(List.duplicate(0.0, b * s_max * hkv * d), {b, s_max, hkv, d}, {:f, 32})
      # Prompts of 5 and 2 tokens written at position 0 (row 1's last 3 are overwritten later).
      prompt = FA.quantize_kv!(Numeric.random({b, 5, hkv, d}, {:f, 32}, 10))
      k0 = QuantizedKV.put_seq(FA.quantize_kv!(empty), 0, prompt)
      cache = %{k: k0, v: k0, lens: [5, 2]}

      Enum.reduce(1..6, cache, fn i, cache ->
        q = Numeric.random({b, 1, h, d}, {:f, 32}, 100 + i)

        k =
          QuantizedKV.put_seq(
            cache.k,
            cache.lens,
            FA.quantize_kv!(Numeric.random({b, 1, hkv, d}, {:f, 32}, 200 + i))
          )

        v =
          QuantizedKV.put_seq(
            cache.v,
            cache.lens,
            FA.quantize_kv!(Numeric.random({b, 1, hkv, d}, {:f, 32}, 300 + i))
          )

        lens = Enum.map(cache.lens, &(&1 + 1))
        seqlens = s32(lens, {b})
        {o, lse} = FA.decode!(q, k, v, cache_seqlens: seqlens)
        # The same attention from forward over the dequantized caches, keys past each row's length hidden.
        {want_o, want_lse} =
          FA.forward_with_states!(q, FA.dequantize_kv!(k), FA.dequantize_kv!(v), seqused_k: seqlens)

        assert Numeric.rel_err(o, want_o) < 1.0e-5 and Numeric.rel_err(lse, want_lse) < 1.0e-5
        %{k: k, v: v, lens: lens}
      end)
    end

    test "plain and quantized caches mix; Nx tensors in, Nx tensors out" do
      nx = fn %Tensor{data: d, shape: s, type: t} -> d |> Nx.from_binary(t) |> Nx.reshape(s) end
      q = Numeric.random({1, 2, 4, 64}, {:f, 32}, 20)
      k = Numeric.random({1, 9, 2, 64}, {:f, 32}, 21)
      kq = FA.quantize_kv!(k, bits: 8)
      assert {:ok, o, lse} = FA.decode(q, kq, k)
      assert {:ok, no, nlse} = FA.decode(nx.(q), FA.quantize_kv!(nx.(k), bits: 8), nx.(k))
      assert %{__struct__: Nx.Tensor} = no
      assert Nx.to_binary(no) == o.data and Nx.to_binary(nlse) == lse.data and Nx.shape(nlse) == lse.shape
      assert %{__struct__: Nx.Tensor} = FA.quantize_kv!(nx.(k)).values
    end

    test "binaries at any alignment (sub-binaries) give the same results" do
      q = Numeric.random({2, 1, 2, 64}, {:f, 32}, 30)
      kq = FA.quantize_kv!(Numeric.random({2, 7, 1, 64}, {:f, 32}, 31), bits: 4, group_size: 32)
      shift = fn %Tensor{data: d} = t -> %{t | data: binary_part(<<0, d::binary>>, 1, byte_size(d))} end
      shifted = %{kq | values: shift.(kq.values), scales: shift.(kq.scales), biases: shift.(kq.biases)}
      lens = s32([7, 3], {2})

      assert FA.decode(shift.(q), shifted, shifted, cache_seqlens: shift.(lens)) ==
               FA.decode(q, kq, kq, cache_seqlens: lens)

      assert FA.dequantize_kv(shifted) == FA.dequantize_kv(kq)
    end
  end

  defp check_decode(c, device) do
    t = c.tensors

    {k, v} =
      case c.quant do
        nil ->
          {t.k, t.v}

        [bits, gs] ->
          {FA.quantize_kv!(t.k, bits: bits, group_size: gs), FA.quantize_kv!(t.v, bits: bits, group_size: gs)}
      end

    window = if c.window, do: c.window |> Enum.map(&(&1 || :infinity)) |> List.to_tuple()

    opts = [
      cache_seqlens: t.cache_seqlens,
      leftpad_k: t.leftpad_k,
      causal: c.causal,
      scale: c.scale,
      window: window,
      softcap: c.softcap
    ]

    empty = for {n, p} <- Enum.zip(Tensor.to_list(t.cache_seqlens), Tensor.to_list(t.leftpad_k)), do: n == p

    for splits <- c.splits do
      assert {:ok, o, lse} = FA.decode(t.q, k, v, [num_splits: splits] ++ device ++ opts)
      assert o.type == t.q.type and o.shape == t.q.shape and lse.type == {:f, 32}
      ctx = "#{c.name} num_splits=#{inspect(splits)} #{inspect(device)}"
      assert Numeric.rel_err(o, t.o) <= c.tol.o, "#{ctx}: o error #{Numeric.rel_err(o, t.o)} > #{c.tol.o}"
      assert Numeric.rel_err(lse, t.lse) <= c.tol.lse, "#{ctx}: lse error #{Numeric.rel_err(lse, t.lse)}"
      # A row with no valid key: o = 0, lse = -inf.
      rows_o = Enum.chunk_every(Tensor.to_list(o), div(Tensor.size(o.shape), c.batch))
      rows_lse = Enum.chunk_every(Tensor.to_list(lse), c.heads * c.seq_q)

      for {true, ro, rl} <- Enum.zip([empty, rows_o, rows_lse]) do
        assert Enum.all?(ro, &(&1 == 0.0)) and Enum.all?(rl, &(&1 == :neg_infinity)), ctx
      end
    end
  end

  describe "merge_states" do
    for c <- Enum.filter(@manifest, &(&1.kind == "merge")) do
      @tag fixture: c.name
      test "#{c.name}: the oracle's merge, stacked or as a list of parts" do
        c = DecodeFixtures.case!(unquote(c.name))
        t = c.tensors
        assert {:ok, o, lse} = FA.merge_states(t.o_parts, t.lse_parts)
        assert o.type == t.o_parts.type and lse.type == {:f, 32}
        assert Numeric.rel_err(o, t.o) <= c.tol.o and Numeric.rel_err(lse, t.lse) <= c.tol.lse
        assert FA.merge_states(unstack(t.o_parts), unstack(t.lse_parts)) == {:ok, o, lse}
      end
    end

    test "rows no part saw: o = 0 and lse = -inf, never NaN" do
      o_parts = ones({2, 1, 3, 2, 4})
      # [P, B, H, Sq]: only part 1 saw (head 0, row 1).
      lse = List.duplicate(:neg_infinity, 12) |> List.replace_at(6 + 1, 0.25)
      {o, lse} = FA.merge_states!(o_parts, f32(lse, {2, 1, 2, 3}))
      assert Tensor.to_list(lse) == [:neg_infinity, 0.25 | List.duplicate(:neg_infinity, 4)]
      # o [B, Sq, H, Dv]: row 1, head 0 is part 1's ones; everything else 0.
      assert Tensor.to_list(o) == List.duplicate(0.0, 8) ++ List.duplicate(1.0, 4) ++ List.duplicate(0.0, 12)
    end
  end

  # [P, ...] as a list of P tensors.
  defp unstack(%Tensor{shape: shape} = t) do
    [p | rest] = Tuple.to_list(shape)
    size = div(byte_size(t.data), p)
    for i <- 0..(p - 1), do: %{t | data: binary_part(t.data, i * size, size), shape: List.to_tuple(rest)}
  end

  describe "put_seq" do
    test "writes rows at one start or per-row starts, and refuses what does not fit" do
      cache = Tensor.from_list(Enum.to_list(1..8), {2, 4}, {:s, 32})
      new = Tensor.from_list([0, 0, 0, 0], {2, 2}, {:s, 32})
      assert Tensor.to_list(Tensor.put_seq(cache, 1, new)) == [1, 0, 0, 4, 5, 0, 0, 8]
      assert Tensor.to_list(Tensor.put_seq(cache, [2, 0], new)) == [1, 2, 0, 0, 0, 0, 7, 8]
      assert_raise ArgumentError, fn -> Tensor.put_seq(cache, 3, new) end
      assert_raise ArgumentError, fn -> Tensor.put_seq(cache, [0], new) end
      assert_raise ArgumentError, fn -> Tensor.put_seq(cache, 0, %{new | type: {:f, 32}}) end
      c4 = FA.quantize_kv!(ones({1, 2, 1, 64}))

      assert_raise ArgumentError, ~r/4-bit/, fn ->
        QuantizedKV.put_seq(c4, 0, FA.quantize_kv!(ones({1, 1, 1, 64}), bits: 8))
      end
    end
  end

  describe "errors (tests/test_quant.py's), never a crash" do
    test "quantize_kv: bits, group size, head dim, rank, dtype, options" do
      x = ones({1, 2, 1, 64})
      assert {:unsupported, msg} = error_of(fn -> FA.quantize_kv(x, bits: 3) end)
      assert msg =~ "bits"
      assert {:unsupported, msg} = error_of(fn -> FA.quantize_kv(x, group_size: 48) end)
      assert msg =~ "group_size"
      assert {:shape, msg} = error_of(fn -> FA.quantize_kv(ones({1, 2, 1, 96}), group_size: 64) end)
      assert msg =~ "multiple of group_size"
      assert {:shape, msg} = error_of(fn -> FA.quantize_kv(ones({2, 1, 64})) end)
      assert msg =~ "[B, S, Hkv, D]"
      ints = %Tensor{data: x.data, shape: x.shape, type: {:s, 32}}
      assert {:dtype, msg} = error_of(fn -> FA.quantize_kv(ints) end)
      assert msg =~ "int32"
      assert {:shape, msg} = error_of(fn -> FA.quantize_kv(%{x | data: binary_part(x.data, 0, 100)}) end)
      assert msg =~ "buffer holds 100 bytes"
      assert {:unsupported, _} = error_of(fn -> FA.quantize_kv(x, bits: "4") end)
      assert {:unsupported, _} = error_of(fn -> FA.quantize_kv(x, bits: -4) end)
      assert {:unsupported, msg} = error_of(fn -> FA.quantize_kv(x, causal: true) end)
      assert msg =~ "unknown option :causal"
      assert {:argument, _} = error_of(fn -> FA.quantize_kv(:x) end)
      assert_raise Error, ~r/bits/, fn -> FA.quantize_kv!(x, bits: 2) end
    end

    test "dequantize_kv checks its parts" do
      c = FA.quantize_kv!(Numeric.random({1, 4, 2, 64}, {:f, 32}, 0), bits: 8, group_size: 32)
      half = %{c.scales | shape: {1, 4, 1, 2}, data: binary_part(c.scales.data, 0, 32)}
      assert {:shape, msg} = error_of(fn -> FA.dequantize_kv(%{c | scales: half}) end)
      assert msg =~ "scales"
      f16 = Tensor.from_list(Tensor.to_list(c.biases), c.biases.shape, {:f, 16})
      assert {:dtype, msg} = error_of(fn -> FA.dequantize_kv(%{c | biases: f16}) end)
      assert msg =~ "one dtype"
      signed = %{c.values | type: {:s, 32}}
      assert {:dtype, msg} = error_of(fn -> FA.dequantize_kv(%{c | values: signed}) end)
      assert msg =~ "uint32"
      assert {:unsupported, _} = error_of(fn -> FA.dequantize_kv(%{c | bits: 5}) end)
      assert {:unsupported, _} = error_of(fn -> FA.dequantize_kv(%{c | group_size: nil}) end)
      assert {:argument, msg} = error_of(fn -> FA.dequantize_kv(c.values) end)
      assert msg =~ "QuantizedKV"
    end

    test "merge_states: shapes and dtypes" do
      assert {:shape, msg} = error_of(fn -> FA.merge_states(ones({2, 1, 3, 2, 4}), ones({2, 1, 3, 2})) end)
      assert msg =~ "[P, B, H, Sq]"

      assert {:dtype, msg} =
               error_of(fn -> FA.merge_states(ones({2, 1, 3, 2, 4}), ones({2, 1, 2, 3}, {:f, 16})) end)

      assert msg =~ "float32"

      assert {:shape, msg} =
               error_of(fn ->
                 FA.merge_states([ones({1, 3, 2, 4}), ones({1, 3, 2, 5})], ones({2, 1, 2, 3}))
               end)

      assert msg =~ "o_parts[1]"
      assert {:shape, _} = error_of(fn -> FA.merge_states([], []) end)

      assert {:argument, msg} =
               error_of(fn -> FA.merge_states([ones({1, 3, 2, 4}), :x], ones({2, 1, 2, 3})) end)

      assert msg =~ "o_parts[1]"
    end

    test "decode: lengths, Sq, dtypes, device, options" do
      q = ones({1, 1, 2, 64})
      k = ones({1, 8, 1, 64})
      assert {:shape, msg} = error_of(fn -> FA.decode(q, k, k, cache_seqlens: s32([9], {1})) end)
      assert msg =~ "cache_seqlens"
      assert {:shape, msg} = error_of(fn -> FA.decode(q, k, k, leftpad_k: s32([-1], {1})) end)
      assert msg =~ "leftpad_k"
      assert {:shape, msg} = error_of(fn -> FA.decode(q, k, k, cache_seqlens: s32([2, 2], {2})) end)
      assert msg =~ "expected [B] = [1]"
      assert {:dtype, msg} = error_of(fn -> FA.decode(q, k, k, cache_seqlens: f32([2.0], {1})) end)
      assert msg =~ "int32"
      assert {:shape, msg} = error_of(fn -> FA.decode(ones({1, 17, 2, 64}), k, k) end)
      assert msg =~ "1 to 16"
      q16 = Tensor.from_list(List.duplicate(1.0, 128), {1, 1, 2, 64}, {:f, 16})
      assert {:dtype, msg} = error_of(fn -> FA.decode(q16, k, k) end)
      assert msg =~ "must match"
      assert {:shape, _} = error_of(fn -> FA.decode(q, k, ones({1, 7, 1, 64})) end)

      assert {:shape, msg} =
               error_of(fn -> FA.decode(ones({1, 1, 3, 64}), ones({1, 8, 2, 64}), ones({1, 8, 2, 64})) end)

      assert msg =~ "multiple of Hkv"
      kq = FA.quantize_kv!(ones({1, 8, 1, 128}))
      assert {:shape, _} = error_of(fn -> FA.decode(q, kq, kq) end)

      {:ok, %{backends: backends}} = FA.info()

      unless :cuda in backends do
        # An explicit :cuda is an error without a GPU backend, never a quiet CPU run.
        assert {kind, _} = error_of(fn -> FA.decode(q, k, k, device: :cuda) end)
        assert kind in [:cuda_unavailable, :unsupported]
      end

      assert {:unsupported, _} = error_of(fn -> FA.decode(q, k, k, device: :tpu) end)
      assert {:unsupported, msg} = error_of(fn -> FA.decode(q, k, k, num_splits: 0) end)
      assert msg =~ "num_splits"
      assert {:unsupported, _} = error_of(fn -> FA.decode(q, k, k, num_splits: -1) end)
      assert {:unsupported, _} = error_of(fn -> FA.decode(q, k, k, scale: -1.0) end)
      assert {:unsupported, _} = error_of(fn -> FA.decode(q, k, k, window: {-1, 0}) end)
      assert {:unsupported, msg} = error_of(fn -> FA.decode(q, k, k, seqused_k: nil) end)
      assert msg =~ "unknown option :seqused_k"
      assert {:argument, msg} = error_of(fn -> FA.decode(q, :k, k) end)
      assert msg =~ "k_cache"
      assert {:argument, msg} = error_of(fn -> FA.decode(q, %{kq | scales: :s}, kq) end)
      assert msg =~ "k_cache.scales"
      assert_raise Error, ~r/1 to 16/, fn -> FA.decode!(ones({1, 17, 2, 64}), k, k) end
      # The defaults: cache_seqlens S_cache, leftpad_k 0, causal, nil meaning not given.
      assert FA.decode(q, k, k) ==
               FA.decode(q, k, k, cache_seqlens: s32([8], {1}), leftpad_k: nil, causal: true)
    end
  end
end
