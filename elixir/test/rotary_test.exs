defmodule FlashNif.RotaryTest do
  # rotary/4 and rotary_backward/4: the float64 oracle's numbers in tests/fixtures/rotary (the
  # fixtures tests/test_rotary.py checks Python against), the round trip, the options, the forms
  # of the result, and the errors. The same cases run on the GPU (tagged :cuda; see test_helper.exs).
  use ExUnit.Case, async: true

  alias ExPhil.Native.FlashAttention, as: FA
  alias ExPhil.Native.FlashAttention.{Error, Tensor}
  alias FlashNif.{Numeric, RotaryFixtures}

  @cases RotaryFixtures.cases()

  # Tables of max_pos rows for r rotated dims (base 10000), as {:f, 32} tensors.
  defp tables(max_pos, r) do
    half = div(r, 2)
    angles = for p <- 0..(max_pos - 1), i <- 0..(half - 1), do: p * :math.pow(10000.0, -i / half)

    {Tensor.from_list(Enum.map(angles, &:math.cos/1), {max_pos, half}, {:f, 32}),
     Tensor.from_list(Enum.map(angles, &:math.sin/1), {max_pos, half}, {:f, 32})}
  end

  test "the fixtures cover every dtype, both layouts, r < d, offsets and positions tensors" do
    assert Enum.sort(Enum.uniq(Enum.map(@cases, & &1.dtype))) == ["bfloat16", "float16", "float32"]
    assert Enum.any?(@cases, & &1.interleaved) and Enum.any?(@cases, &(not &1.interleaved))
    assert Enum.any?(@cases, &(&1.rotary_dim < &1.head_dim))
    assert Enum.any?(@cases, &(&1.offset == nil)) and Enum.any?(@cases, &(&1.offset != nil and &1.offset > 0))
  end

  for c <- @cases do
    @tag fixture: c.name
    test "#{c.name}: rotary and rotary_backward match the oracle on the CPU" do
      check_fixture(unquote(c.name), device: :cpu)
    end

    @tag :cuda
    test "#{c.name}: rotary and rotary_backward match the oracle on the GPU" do
      check_fixture(unquote(c.name), device: :cuda)
    end
  end

  defp check_fixture(name, extra) do
    c = Enum.find(@cases, &(&1.name == name))
    t = c.tensors
    opts = c.opts ++ extra
    assert {:ok, y} = FA.rotary(t.x, t.cos, t.sin, opts)
    assert {:ok, dx} = FA.rotary_backward(t.dy, t.cos, t.sin, opts)
    assert y.type == t.x.type and y.shape == t.x.shape and dx.type == t.dy.type

    for {output, got} <- [y: y, dx: dx] do
      err = Numeric.rel_err(got, Map.fetch!(t, output))
      tol = c.tol[output]
      assert err <= tol, "#{c.name} #{output}: relative error #{inspect(err)} > tolerance #{tol} (#{c.dtype})"
    end
  end

  describe "semantics" do
    setup do
      x = Numeric.random({2, 5, 3, 12}, {:f, 32}, 41)
      {cos, sin} = tables(9, 8)
      {:ok, x: x, cos: cos, sin: sin}
    end

    test "rotary_backward undoes rotary; the dims past r pass through", %{x: x, cos: cos, sin: sin} do
      for interleaved <- [false, true], positions <- [nil, 4] do
        opts = [interleaved: interleaved, positions: positions]
        {:ok, y} = FA.rotary(x, cos, sin, opts)
        refute y == x
        {:ok, back} = FA.rotary_backward(y, cos, sin, opts)
        assert Numeric.rel_err(back, x) < 1.0e-6
        # each head's last 4 (of 12) dims are unchanged
        rows = fn t -> for <<row::binary-size(48) <- t.data>>, do: binary_part(row, 32, 16) end
        assert rows.(y) == rows.(x)
      end
    end

    test "an offset is the positions tensor s + offset; nil is offset 0", %{x: x, cos: cos, sin: sin} do
      positions = Tensor.from_list(for(_ <- 1..2, s <- 0..4, do: s + 3), {2, 5}, {:s, 32})
      {:ok, by_tensor} = FA.rotary(x, cos, sin, positions: positions)
      assert {:ok, ^by_tensor} = FA.rotary(x, cos, sin, positions: 3)
      assert FA.rotary(x, cos, sin, positions: nil) == FA.rotary(x, cos, sin, positions: 0)
      assert FA.rotary(x, cos, sin) == FA.rotary(x, cos, sin, positions: 0, interleaved: false, device: :cpu)
      refute FA.rotary(x, cos, sin, interleaved: true) == FA.rotary(x, cos, sin)
    end

    test "Nx tensors in, Nx tensors out", %{x: x, cos: cos, sin: sin} do
      nx = fn %Tensor{data: d, shape: s, type: t} -> d |> Nx.from_binary(t) |> Nx.reshape(s) end
      {:ok, y} = FA.rotary(x, cos, sin, positions: 1)
      {:ok, ny} = FA.rotary(nx.(x), nx.(cos), nx.(sin), positions: 1)
      assert %{__struct__: Nx.Tensor} = ny
      assert Nx.to_binary(ny) == y.data and Nx.shape(ny) == y.shape
    end

    test "the ! variants", %{x: x, cos: cos, sin: sin} do
      {:ok, y} = FA.rotary(x, cos, sin)
      assert FA.rotary!(x, cos, sin) == y
      assert {:ok, FA.rotary_backward!(y, cos, sin)} == FA.rotary_backward(y, cos, sin)
      assert_raise Error, ~r/max_pos = 9/, fn -> FA.rotary!(x, cos, sin, positions: 5) end
    end
  end

  describe "errors" do
    setup do
      x = Numeric.random({2, 4, 3, 16}, {:f, 32}, 42)
      {cos, sin} = tables(8, 16)
      {:ok, x: x, cos: cos, sin: sin}
    end

    defp error_of(fun) do
      assert {:error, {kind, message}} = Task.await(Task.async(fun))
      {kind, message}
    end

    test "r > head_dim, mismatched or malformed tables", %{x: x, cos: cos, sin: sin} do
      {wide, _} = tables(8, 18)
      assert {:shape, msg} = error_of(fn -> FA.rotary(x, wide, wide) end)
      assert msg =~ "R = 2 * 9 = 18" and msg =~ "head_dim 16"
      {_, other} = tables(9, 16)
      assert {:shape, msg} = error_of(fn -> FA.rotary(x, cos, other) end)
      assert msg =~ "cos has shape [8, 8] but sin has shape [9, 8]"
      assert {:shape, msg} = error_of(fn -> FA.rotary(%{x | shape: {8, 3, 16}}, cos, sin) end)
      assert msg =~ "x must have rank 4"
      assert {:shape, msg} = error_of(fn -> FA.rotary_backward(%{x | shape: {8, 3, 16}}, cos, sin) end)
      assert msg =~ "dy must have rank 4"
    end

    test "positions outside the tables are errors, not reads past them", %{x: x, cos: cos, sin: sin} do
      bad = Tensor.from_list([0, 1, 2, 3, 4, 5, 8, 7], {2, 4}, {:s, 32})
      assert {:shape, msg} = error_of(fn -> FA.rotary(x, cos, sin, positions: bad) end)
      assert msg =~ "positions[1, 2] = 8 is outside the tables' rows [0, max_pos = 8)"
      negative = Tensor.from_list([0, -1, 2, 3, 4, 5, 6, 7], {2, 4}, {:s, 32})
      assert {:shape, msg} = error_of(fn -> FA.rotary_backward(x, cos, sin, positions: negative) end)
      assert msg =~ "positions[0, 1] = -1"
      assert {:shape, msg} = error_of(fn -> FA.rotary(x, cos, sin, positions: 5) end)
      assert msg =~ "max_pos = 8"
      assert {:unsupported, msg} = error_of(fn -> FA.rotary(x, cos, sin, positions: -1) end)
      assert msg =~ "non-negative"
      wrong = Tensor.from_list(List.duplicate(0, 8), {4, 2}, {:s, 32})
      assert {:shape, msg} = error_of(fn -> FA.rotary(x, cos, sin, positions: wrong) end)
      assert msg =~ "expected [batch, seq] = [2, 4]"
    end

    test "wrong types", %{x: x, cos: cos, sin: sin} do
      half = Tensor.from_list(List.duplicate(0.5, 64), {8, 8}, {:f, 16})
      assert {:dtype, msg} = error_of(fn -> FA.rotary(x, half, half) end)
      assert msg =~ "cos has dtype float16; it must be float32"
      ints = %Tensor{data: x.data, shape: x.shape, type: {:s, 32}}
      assert {:dtype, _} = error_of(fn -> FA.rotary(ints, cos, sin) end)
      floats = Tensor.from_list(List.duplicate(0.0, 8), {2, 4}, {:f, 32})
      assert {:dtype, msg} = error_of(fn -> FA.rotary(x, cos, sin, positions: floats) end)
      assert msg =~ "positions has dtype float32; it must be int32"
    end

    test "bad options", %{x: x, cos: cos, sin: sin} do
      assert {:unsupported, msg} = error_of(fn -> FA.rotary(x, cos, sin, causal: true) end)
      assert msg =~ "unknown option :causal" and msg =~ ":interleaved"
      assert {:unsupported, _} = error_of(fn -> FA.rotary(x, cos, sin, interleaved: 1) end)
      assert {:unsupported, _} = error_of(fn -> FA.rotary(x, cos, sin, positions: 1.5) end)
      assert {:unsupported, _} = error_of(fn -> FA.rotary(x, cos, sin, device: :tpu) end)
      assert {:unsupported, _} = error_of(fn -> FA.rotary(x, cos, sin, :oops) end)
      assert {:argument, _} = error_of(fn -> FA.rotary(x, :cos, sin) end)
    end
  end
end
