defmodule FlashNif.ErrorsTest do
  # Bad inputs come back as {:error, {kind, message}} with a readable message, the calling
  # process lives on, and the ! variants raise ExPhil.Native.FlashAttention.Error.
  use ExUnit.Case, async: true

  alias ExPhil.Native.FlashAttention, as: FA
  alias ExPhil.Native.FlashAttention.{Error, Tensor}
  alias FlashNif.Numeric

  setup_all do
    q = Numeric.random({1, 5, 4, 8}, {:f, 32}, 1)
    k = Numeric.random({1, 6, 2, 8}, {:f, 32}, 2)
    v = Numeric.random({1, 6, 2, 8}, {:f, 32}, 3)
    {:ok, o, lse} = FA.forward_with_states(q, k, v)
    {:ok, q: q, k: k, v: v, o: o, lse: lse}
  end

  # Runs the call in a separate process that must exit normally with {:error, {kind, message}}.
  defp error_of(fun) do
    task = Task.async(fun)
    assert {:error, {kind, message}} = Task.await(task)
    assert is_atom(kind) and is_binary(message) and message != ""
    {kind, message}
  end

  describe "tensors" do
    test "a binary of the wrong size", %{q: q, k: k, v: v} do
      short = %{q | data: binary_part(q.data, 0, byte_size(q.data) - 4)}
      {kind, msg} = error_of(fn -> FA.forward(short, k, v) end)
      assert kind == :shape
      assert msg =~ "q has shape [1, 5, 4, 8]" and msg =~ "buffer holds 636 bytes"
    end

    test "mismatched shapes", %{q: q, k: k, v: v} do
      assert {:shape, msg} = error_of(fn -> FA.forward(q, k, %{v | shape: {1, 3, 4, 8}}) end)
      assert msg =~ "k has shape" and msg =~ "v has shape"

      k2 = Numeric.random({2, 6, 2, 8}, {:f, 32}, 4)
      assert {:shape, msg} = error_of(fn -> FA.forward(q, k2, k2) end)
      assert msg =~ "batch mismatch"

      k3 = Numeric.random({1, 6, 3, 8}, {:f, 32}, 5)
      assert {:shape, msg} = error_of(fn -> FA.forward(q, k3, k3) end)
      assert msg =~ "multiple"

      k4 = Numeric.random({1, 6, 2, 4}, {:f, 32}, 6)
      assert {:shape, msg} = error_of(fn -> FA.forward(q, k4, k4) end)
      assert msg =~ "head_dim mismatch"
    end

    test "wrong rank", %{q: q, k: k, v: v} do
      assert {:shape, msg} = error_of(fn -> FA.forward(%{q | shape: {5, 4, 8}}, k, v) end)
      assert msg =~ "rank 4"
    end

    test "a shape that is not a tuple of non-negative integers", %{q: q, k: k, v: v} do
      assert {:shape, _} = error_of(fn -> FA.forward(%{q | shape: [1, 5, 4, 8]}, k, v) end)
      assert {:shape, _} = error_of(fn -> FA.forward(%{q | shape: {1, -5, 4, 8}}, k, v) end)
      assert {:shape, _} = error_of(fn -> FA.forward(%{q | shape: {1, 5.0, 4, 8}}, k, v) end)
    end

    test "an unknown type, and types that do not match", %{q: q, k: k, v: v, o: o, lse: lse} do
      assert {:dtype, msg} = error_of(fn -> FA.forward(%{q | type: {:s, 64}}, k, v) end)
      assert msg =~ "{:s, 64}" and msg =~ "float32, float16 or bfloat16"
      # a mask's type is named as the core names it
      assert {:dtype, msg} = error_of(fn -> FA.forward(%{q | type: {:s, 32}}, k, v) end)
      assert msg == "q has dtype int32; expected float32, float16 or bfloat16"
      assert {:dtype, _} = error_of(fn -> FA.forward(q, %{k | type: {:f, 64}}, v) end)

      half = Tensor.from_list(List.duplicate(0.5, 6 * 2 * 8 * 2), {1, 6, 2, 16}, {:f, 16})
      assert {:dtype, msg} = error_of(fn -> FA.forward(q, half, half) end)
      assert msg =~ "share one dtype"

      lse16 = %Tensor{
        data: binary_part(lse.data, 0, div(byte_size(lse.data), 2)),
        shape: lse.shape,
        type: {:f, 16}
      }

      assert {:dtype, msg} = error_of(fn -> FA.backward(o, q, k, v, o, lse16) end)
      assert msg == "lse has dtype float16; it must be float32"
      # lse's own rule from the first message, not the generic list of q/k/v types
      assert {:dtype, msg} = error_of(fn -> FA.backward(o, q, k, v, o, %{lse | type: {:f, 64}}) end)
      assert msg == "lse has dtype {:f, 64}; it must be float32"
    end

    test "backward states that do not fit the inputs", %{q: q, k: k, v: v, o: o, lse: lse} do
      assert {:shape, msg} = error_of(fn -> FA.backward(o, q, k, v, o, %{lse | shape: {1, 5, 4}}) end)
      assert msg =~ "lse has shape"
      assert {:shape, msg} = error_of(fn -> FA.backward(%{o | shape: {1, 4, 5, 8}}, q, k, v, o, lse) end)
      assert msg =~ "d_out has shape [1, 4, 5, 8]"
    end

    test "arguments that are not tensors", %{q: q, k: k} do
      assert {:argument, msg} = error_of(fn -> FA.forward(q, k, nil) end)
      assert msg =~ "v must be an ExPhil.Native.FlashAttention.Tensor or an Nx.Tensor"
      assert {:argument, _} = error_of(fn -> FA.forward(q, k, %{data: k.data, shape: k.shape}) end)
      assert {:argument, msg} = error_of(fn -> FA.forward(q, k, %{k | data: [1, 2, 3]}) end)
      assert msg =~ "v.data must be a binary"
      assert {:argument, msg} = error_of(fn -> FA.forward(q, k, %{k | data: <<1::3>>}) end)
      assert msg =~ "v.data"
    end
  end

  describe "options" do
    test "unknown keys and wrong value types", %{q: q, k: k, v: v} do
      assert {:unsupported, msg} = error_of(fn -> FA.forward(q, k, v, casual: true) end)
      assert msg =~ "unknown option :casual"
      assert {:unsupported, msg} = error_of(fn -> FA.forward(q, k, v, causal: 1) end)
      assert msg =~ ":causal option must be true or false"
      assert {:unsupported, msg} = error_of(fn -> FA.forward(q, k, v, scale: "0.5") end)
      assert msg =~ ":scale option"
      assert {:unsupported, msg} = error_of(fn -> FA.forward(q, k, v, device: :tpu) end)
      assert msg =~ ":device option must be :auto, :cpu or :cuda"
      assert {:unsupported, msg} = error_of(fn -> FA.forward(q, k, v, deterministic: :yes) end)
      assert msg =~ ":deterministic option must be true or false"
      assert {:unsupported, _} = error_of(fn -> FA.forward(q, k, v, %{causal: true}) end)
      assert {:unsupported, _} = error_of(fn -> FA.forward(q, k, v, [:causal]) end)
      assert {:unsupported, _} = error_of(fn -> FA.forward(q, k, v, scale: 10 ** 400) end)
    end

    test "scale values the core rejects", %{q: q, k: k, v: v} do
      assert {:unsupported, msg} = error_of(fn -> FA.forward(q, k, v, scale: -1.0) end)
      assert msg =~ "scale must be a finite positive number"
      assert {:unsupported, _} = error_of(fn -> FA.forward(q, k, v, scale: 0) end)
    end

    test "an explicit :cuda is an error when no GPU backend can run, never a quiet CPU run",
         %{q: q, k: k, v: v} do
      {:ok, %{backends: backends}} = FA.info()

      if :cuda in backends do
        assert {:ok, _} = FA.forward(q, k, v, device: :cuda)
      else
        assert {kind, _} = error_of(fn -> FA.forward(q, k, v, device: :cuda) end)
        assert kind in [:cuda_unavailable, :unsupported]
      end
    end
  end

  describe "masks" do
    # q {1, 5, 4, 8}, k and v {1, 6, 2, 8}: Sq = 5, Sk = 6, one block of 128 each way.
    defp s32(list, shape), do: Tensor.from_list(list, shape, {:s, 32})
    defp u8(list, shape), do: Tensor.from_list(list, shape, {:u, 8})

    test "windows: negative sides, wrong forms, sides past int64", %{q: q, k: k, v: v} do
      for w <- [{-1, 0}, {0, -3}, {1, 2, 3}, 3, {1.0, 2}, {:infinity, nil}, [1, 2], {2 ** 63, 0}] do
        assert {:unsupported, msg} = error_of(fn -> FA.forward(q, k, v, window: w) end)
        assert msg =~ "the :window option must be {left, right}, each a non-negative integer or :infinity"
        assert msg =~ inspect(w)
      end
    end

    test "unknown keys stay an error, next to the mask options", %{q: q, k: k, v: v} do
      assert {:unsupported, msg} = error_of(fn -> FA.forward(q, k, v, windows: {1, 1}) end)
      assert msg =~ "unknown option :windows" and msg =~ ":segment_ids"
    end

    test "segment ids: shapes, types, form", %{q: q, k: k, v: v, o: o, lse: lse} do
      seg_q = s32([0, 0, 1, 1, 1], {1, 5})
      seg_k = s32([0, 0, 0, 1, 1, 1], {1, 6})

      assert {:shape, msg} = error_of(fn -> FA.forward(q, k, v, segment_ids: {seg_k, seg_k}) end)
      assert msg == "seg_q has shape [1, 6]; expected [batch, seq_q] = [1, 5]"
      assert {:shape, msg} = error_of(fn -> FA.backward(o, q, k, v, o, lse, segment_ids: {seg_q, seg_q}) end)
      assert msg == "seg_k has shape [1, 5]; expected [batch, seq_k] = [1, 6]"

      assert {:shape, msg} =
               error_of(fn -> FA.forward(q, k, v, segment_ids: {%{seg_q | shape: {5}}, seg_k}) end)

      assert msg =~ "seg_q has shape [5]"
      short = %{seg_q | data: binary_part(seg_q.data, 0, 16)}
      assert {:shape, msg} = error_of(fn -> FA.forward(q, k, v, segment_ids: {short, seg_k}) end)
      assert msg =~ "seg_q has shape [1, 5], which needs 20 bytes, but its buffer holds 16 bytes"

      as_f32 = Tensor.from_list([0.0, 0.0, 1.0, 1.0, 1.0], {1, 5}, {:f, 32})
      assert {:dtype, msg} = error_of(fn -> FA.forward(q, k, v, segment_ids: {as_f32, seg_k}) end)
      assert msg == "seg_q has dtype float32; it must be int32"
      s64 = %Tensor{data: :binary.copy(<<0::64>>, 6), shape: {1, 6}, type: {:s, 64}}
      assert {:dtype, msg} = error_of(fn -> FA.forward(q, k, v, segment_ids: {seg_q, s64}) end)
      assert msg == "seg_k has dtype {:s, 64}; it must be int32"

      assert {:unsupported, msg} = error_of(fn -> FA.forward(q, k, v, segment_ids: seg_q) end)
      assert msg =~ "the :segment_ids option must be a tuple {seg_q, seg_k}"
      assert {:argument, msg} = error_of(fn -> FA.forward(q, k, v, segment_ids: {seg_q, [0, 1]}) end)
      assert msg =~ "seg_k must be an ExPhil.Native.FlashAttention.Tensor or an Nx.Tensor"
    end

    test "padding: shapes, types, lengths outside [0, Sk], leftpad past seqused", ctx do
      %{q: q, k: k, v: v, o: o, lse: lse} = ctx
      assert {:shape, msg} = error_of(fn -> FA.forward(q, k, v, seqused_k: s32([6, 6], {2})) end)
      assert msg == "seqused_k has shape [2]; expected [batch] = [1]"
      assert {:shape, msg} = error_of(fn -> FA.forward(q, k, v, seqused_k: s32([7], {1})) end)
      assert msg == "seqused_k[0] = 7 is outside [0, Sk = 6]"
      assert {:shape, msg} = error_of(fn -> FA.backward(o, q, k, v, o, lse, seqused_k: s32([-1], {1})) end)
      assert msg == "seqused_k[0] = -1 is outside [0, Sk = 6]"
      assert {:shape, msg} = error_of(fn -> FA.forward(q, k, v, leftpad_k: s32([7], {1})) end)
      assert msg == "leftpad_k[0] = 7 is outside [0, Sk = 6]"

      assert {:shape, msg} =
               error_of(fn -> FA.forward(q, k, v, seqused_k: s32([2], {1}), leftpad_k: s32([3], {1})) end)

      assert msg =~ "leftpad_k[0] = 3 is past the end of the valid keys (2); it must be at most seqused_k[0]"
      assert {:dtype, msg} = error_of(fn -> FA.forward(q, k, v, leftpad_k: u8([1, 0, 0, 0], {4})) end)
      assert msg == "leftpad_k has dtype uint8; it must be int32"
      assert {:argument, msg} = error_of(fn -> FA.forward(q, k, v, seqused_k: 6) end)
      assert msg =~ "seqused_k must be an ExPhil.Native.FlashAttention.Tensor or an Nx.Tensor"
    end

    test "block masks: shapes and types", %{q: q, k: k, v: v, o: o, lse: lse} do
      for shape <- [{1, 3, 1, 1}, {2, 1, 1, 1}, {1, 1, 1, 2}, {1, 1, 1}] do
        bm = u8(List.duplicate(1, Tensor.size(shape)), shape)
        assert {:shape, msg} = error_of(fn -> FA.forward(q, k, v, block_mask: bm) end)
        assert msg =~ "block_mask has shape"
        assert msg =~ "expected [1 or 1, 4 or 1, ceil(Sq/128) = 1, ceil(Sk/128) = 1]"
      end

      assert {:dtype, msg} =
               error_of(fn -> FA.backward(o, q, k, v, o, lse, block_mask: s32([1], {1, 1, 1, 1})) end)

      assert msg == "block_mask has dtype int32; it must be bool or uint8"
    end

    test "varlen: cu_seqlens that decrease, overrun, start past 0 or disagree; wrong ranks" do
      q = Numeric.random({5, 4, 8}, {:f, 32}, 1)
      k = Numeric.random({7, 2, 8}, {:f, 32}, 2)
      cu_k = s32([0, 3, 7], {3})

      assert {:shape, msg} =
               error_of(fn -> FA.varlen_forward(q, k, k, s32([0, 3, 2, 5], {4}), s32([0, 3, 4, 7], {4})) end)

      assert msg == "cu_seqlens_q must be non-decreasing; cu_seqlens_q[2] = 2 < cu_seqlens_q[1] = 3"
      assert {:shape, msg} = error_of(fn -> FA.varlen_forward(q, k, k, s32([0, 2, 6], {3}), cu_k) end)
      assert msg == "cu_seqlens_q[2] = 6 must equal the number of packed q rows (5)"

      assert {:shape, msg} =
               error_of(fn -> FA.varlen_forward(q, k, k, s32([0, 2, 5], {3}), s32([0, 3, 8], {3})) end)

      assert msg =~ "cu_seqlens_k[2] = 8"
      assert {:shape, msg} = error_of(fn -> FA.varlen_forward(q, k, k, s32([1, 2, 5], {3}), cu_k) end)
      assert msg == "cu_seqlens_q[0] must be 0; got 1"
      assert {:shape, msg} = error_of(fn -> FA.varlen_forward(q, k, k, s32([0, 5], {2}), cu_k) end)
      assert msg =~ "cu_seqlens_q has shape [2] but cu_seqlens_k has shape [3]"
      assert {:shape, _} = error_of(fn -> FA.varlen_forward(q, k, k, s32([], {0}), s32([], {0})) end)

      as_f32 = Tensor.from_list([0.0, 2.0, 5.0], {3}, {:f, 32})
      assert {:dtype, msg} = error_of(fn -> FA.varlen_forward(q, k, k, as_f32, cu_k) end)
      assert msg == "cu_seqlens_q has dtype float32; it must be int32"

      q4 = %{q | shape: {1, 5, 4, 8}}
      assert {:shape, msg} = error_of(fn -> FA.varlen_forward(q4, k, k, s32([0, 2, 5], {3}), cu_k) end)
      assert msg =~ "q must have rank 3 [total, heads, head_dim] in a varlen call"
    end

    test "varlen: backward states that do not fit, and options that do not apply" do
      q = Numeric.random({5, 4, 8}, {:f, 32}, 1)
      k = Numeric.random({7, 2, 8}, {:f, 32}, 2)
      {cu_q, cu_k} = {s32([0, 2, 5], {3}), s32([0, 3, 7], {3})}
      lse = Tensor.from_list(List.duplicate(0.0, 20), {4, 5}, {:f, 32})
      bad_lse = %{lse | shape: {5, 4}}
      assert {:shape, msg} = error_of(fn -> FA.varlen_backward(q, q, k, k, q, bad_lse, cu_q, cu_k) end)
      assert msg == "lse has shape [5, 4]; expected [heads, total_q] = [4, 5]"

      assert {:shape, msg} =
               error_of(fn -> FA.varlen_backward(%{q | shape: {4, 5, 8}}, q, k, k, q, lse, cu_q, cu_k) end)

      assert msg =~ "d_out has shape [4, 5, 8]"

      for {key, value} <- [segment_ids: {cu_q, cu_k}, seqused_k: cu_q, leftpad_k: cu_q, block_mask: cu_q] do
        assert {:unsupported, msg} =
                 error_of(fn -> FA.varlen_forward(q, k, k, cu_q, cu_k, [{key, value}]) end)

        assert msg =~ "the #{inspect(key)} option does not apply to a varlen call"

        assert {:unsupported, ^msg} =
                 error_of(fn -> FA.varlen_backward(q, q, k, k, q, lse, cu_q, cu_k, [{key, value}]) end)
      end

      assert {:unsupported, msg} = error_of(fn -> FA.varlen_forward(q, k, k, cu_q, cu_k, window: {-1, 0}) end)
      assert msg =~ "the :window option"
      assert {:argument, msg} = error_of(fn -> FA.varlen_forward(q, k, k, [0, 2, 5], cu_k) end)
      assert msg =~ "cu_seqlens_q must be an ExPhil.Native.FlashAttention.Tensor or an Nx.Tensor"
      error = assert_raise Error, fn -> FA.varlen_forward!(q, k, k, cu_k, cu_k) end
      assert error.kind == :shape
      assert_raise Error, ~r/\(shape\)/, fn -> FA.varlen_backward!(q, q, k, k, q, bad_lse, cu_q, cu_k) end
    end
  end

  test "the NIF's own checks answer terms the wrapper never sends", ctx do
    nif = ExPhil.Native.FlashAttention.Nif

    opts = %{
      causal: true,
      scale: nil,
      device: :cpu,
      deterministic: false,
      mode: :auto,
      precision: :exact,
      window: {nil, nil},
      softcap: nil,
      alibi_slopes: nil,
      sinks: nil
    }

    assert {:argument, msg} = error_of(fn -> nif.forward([], %{}, opts) end)
    assert msg =~ "expected the list"
    assert {:argument, msg} = error_of(fn -> nif.forward([1, 2, 3], %{}, Map.delete(opts, :window)) end)
    assert msg =~ "window"

    # The modifiers: every key present, softcap nil or a number, the tensors nil or wired.
    wired = for t <- [ctx.q, ctx.k, ctx.v], do: {t.data, Tuple.to_list(t.shape), "float32"}
    assert {:ok, _, _} = nif.forward(wired, %{}, opts)

    for key <- [:softcap, :alibi_slopes, :sinks] do
      assert {:argument, msg} = error_of(fn -> nif.forward(wired, %{}, Map.delete(opts, key)) end)
      assert msg =~ ~r/^options must be a map (with the key|whose) #{key}/
    end

    assert {:argument, msg} = error_of(fn -> nif.forward(wired, %{}, %{opts | softcap: "1"}) end)
    assert msg =~ "softcap is nil or a float"
    assert {:argument, msg} = error_of(fn -> nif.forward(wired, %{}, %{opts | sinks: [0.0]}) end)
    assert msg =~ "sinks"
    assert {:argument, msg} = error_of(fn -> nif.forward([1, 2, 3], %{}, %{opts | window: {-1.5, nil}}) end)
    assert msg =~ "window"
    assert {:argument, msg} = error_of(fn -> nif.backward([1, 2, 3, 4, 5, 6], [], opts) end)
    assert msg =~ "d_out must be"
  end

  test "a panic in native code comes back as an :internal error and the VM lives on" do
    assert {:internal, msg} = error_of(fn -> ExPhil.Native.FlashAttention.Nif.debug_panic() end)
    assert msg =~ "panic"
    assert {:ok, _} = FA.info()
  end

  test "the ! variants raise ExPhil.Native.FlashAttention.Error", %{q: q, k: k, v: v, o: o, lse: lse} do
    error = assert_raise Error, fn -> FA.forward!(q, k, v, causal: :maybe) end
    assert error.kind == :unsupported
    assert Exception.message(error) =~ "(unsupported) the :causal option"
    assert_raise Error, ~r/\(shape\)/, fn -> FA.forward_with_states!(%{q | shape: {1, 5, 4, 9}}, k, v) end
    assert_raise Error, ~r/\(shape\)/, fn -> FA.backward!(o, q, k, v, o, %{lse | shape: {5}}) end

    assert {%Tensor{}, %Tensor{}} = FA.forward_with_states!(q, k, v)
    assert {%Tensor{}, %Tensor{}, %Tensor{}} = FA.backward!(o, q, k, v, o, lse)
  end

  test "after all of the above, calls still work in this process", %{q: q, k: k, v: v, o: o} do
    assert {:ok, ^o} = FA.forward(q, k, v)
  end
end
