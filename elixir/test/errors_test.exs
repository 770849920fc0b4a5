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
      assert {:dtype, msg} = error_of(fn -> FA.forward(%{q | type: {:s, 32}}, k, v) end)
      assert msg =~ "{:s, 32}" and msg =~ "float32, float16 or bfloat16"
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
