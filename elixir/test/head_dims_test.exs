defmodule FlashNif.HeadDimsTest do
  # Any head dim from 1 to 256, and v with its own head dim Dv (o, d_out and dv take Dv; q, k, dq
  # and dk take D): shapes, a float64 forward written out here, the backward against central
  # finite differences of the forward (as gradient_check_test.exs), and the errors.
  use ExUnit.Case, async: true

  alias ExPhil.Native.FlashAttention, as: FA
  alias ExPhil.Native.FlashAttention.Tensor
  alias FlashNif.Numeric

  @h 1.0e-2

  # {batch, seq_q, seq_k, heads, kv_heads, d, dv}
  for {label, opts, dims} <- [
        {"Dv < D, causal GQA, Sq < Sk", [causal: true], {1, 3, 4, 2, 1, 5, 3}},
        {"Dv > D, full attention, Sq > Sk", [causal: false], {2, 3, 2, 2, 2, 2, 7}},
        {"odd D = Dv = 3, window", [causal: false, window: {1, 0}], {1, 3, 4, 2, 1, 3, 3}},
        {"D = 1, Dv = 4, causal, Sq > Sk (a row that sees no key)", [causal: true], {1, 3, 2, 2, 1, 1, 4}}
      ] do
    test "forward and gradients: #{label}" do
      {b, sq, sk, h, hkv, d, dv} = unquote(Macro.escape(dims))
      opts = unquote(Macro.escape(opts))
      q = Numeric.random({b, sq, h, d}, {:f, 32}, 1)
      k = Numeric.random({b, sk, hkv, d}, {:f, 32}, 2)
      v = Numeric.random({b, sk, hkv, dv}, {:f, 32}, 3)
      w = Numeric.random({b, sq, h, dv}, {:f, 32}, 4)

      {:ok, o, lse} = FA.forward_with_states(q, k, v, opts)
      assert o.shape == {b, sq, h, dv} and lse.shape == {b, h, sq}
      err = Numeric.rel_err(Tensor.to_list(o), reference(q, k, v, opts))
      assert err < 1.0e-5, "o: relative error #{err} against the float64 forward"

      {:ok, dq, dk, dv_grad} = FA.backward(w, q, k, v, o, lse, opts)
      assert {dq.shape, dk.shape, dv_grad.shape} == {q.shape, k.shape, v.shape}

      loss = fn q, k, v ->
        o = FA.forward!(q, k, v, opts)
        Enum.zip(Tensor.to_list(o), Tensor.to_list(w)) |> Enum.reduce(0.0, fn {a, b}, s -> s + a * b end)
      end

      numeric = %{dq: fd(q, &loss.(&1, k, v)), dk: fd(k, &loss.(q, &1, v)), dv: fd(v, &loss.(q, k, &1))}

      for {name, analytic} <- [dq: dq, dk: dk, dv: dv_grad] do
        err = Numeric.rel_err(Tensor.to_list(analytic), numeric[name])
        assert err < 2.0e-3, "#{name}: relative error #{err} against finite differences"
      end
    end
  end

  test "DeepSeek's shapes (D = 192, Dv = 128) in bf16, and the default scale is 1/sqrt(D)" do
    q = Numeric.random({1, 5, 2, 192}, {:bf, 16}, 5)
    k = Numeric.random({1, 6, 1, 192}, {:bf, 16}, 6)
    v = Numeric.random({1, 6, 1, 128}, {:bf, 16}, 7)
    {:ok, o} = FA.forward(q, k, v)
    assert o.shape == {1, 5, 2, 128} and o.type == {:bf, 16}
    assert FA.forward!(q, k, v, scale: 1 / :math.sqrt(192)) == o
    {:ok, o, lse} = FA.forward_with_states(q, k, v)
    {:ok, dq, dk, dv} = FA.backward(o, q, k, v, o, lse)
    assert {dq.shape, dk.shape, dv.shape} == {{1, 5, 2, 192}, {1, 6, 1, 192}, {1, 6, 1, 128}}
  end

  test "varlen takes v's own head dim" do
    cu = Tensor.from_list([0, 2, 5], {3}, {:s, 32})
    q = Numeric.random({5, 2, 3}, {:f, 32}, 8)
    k = Numeric.random({5, 1, 3}, {:f, 32}, 9)
    v = Numeric.random({5, 1, 7}, {:f, 32}, 10)
    {:ok, o, lse} = FA.varlen_forward_with_states(q, k, v, cu, cu, causal: false)
    assert o.shape == {5, 2, 7}
    {:ok, dq, dk, dv} = FA.varlen_backward(o, q, k, v, o, lse, cu, cu, causal: false)
    assert {dq.shape, dk.shape, dv.shape} == {q.shape, k.shape, v.shape}
  end

  test "head dims out of range and o / d_out shapes that disagree with v are :shape errors" do
    q = Numeric.random({1, 3, 2, 5}, {:f, 32}, 11)
    k = Numeric.random({1, 4, 1, 5}, {:f, 32}, 12)
    v = Numeric.random({1, 4, 1, 3}, {:f, 32}, 13)

    for bad <- [0, 257] do
      v_bad = Tensor.from_list(List.duplicate(0.0, 4 * bad), {1, 4, 1, bad}, {:f, 32})
      assert {:error, {:shape, msg}} = FA.forward(q, k, v_bad)
      assert msg =~ "v's head_dim must be between 1 and 256"
    end

    {:ok, o, lse} = FA.forward_with_states(q, k, v)
    assert {:error, {:shape, msg}} = FA.backward(o, q, k, v, q, lse)
    assert msg == "o has shape [1, 3, 2, 5]; it must be q's shape with v's head_dim, [1, 3, 2, 3]"
    assert {:error, {:shape, msg}} = FA.backward(q, q, k, v, o, lse)
    assert msg =~ "d_out has shape [1, 3, 2, 5]"
    assert {:error, {:shape, _}} = FA.forward(q, k, Numeric.random({1, 3, 1, 3}, {:f, 32}, 14))
  end

  @tag :cuda
  test "device: :cuda takes any head dims (the GPU's padding layer) and agrees with the CPU" do
    for {d, dv} <- [{59, 59}, {192, 128}, {3, 200}] do
      q = Numeric.random({2, 37, 4, d}, {:f, 32}, 15)
      k = Numeric.random({2, 53, 2, d}, {:f, 32}, 16)
      v = Numeric.random({2, 53, 2, dv}, {:f, 32}, 17)
      {:ok, o, lse} = FA.forward_with_states(q, k, v, device: :cuda)
      {:ok, o_cpu, _} = FA.forward_with_states(q, k, v, device: :cpu)
      assert Numeric.rel_err(o, o_cpu) < 1.0e-5

      {:ok, dq, dk, dv_grad} = FA.backward(o, q, k, v, o, lse, device: :cuda, deterministic: true)
      {:ok, dq_c, dk_c, dv_c} = FA.backward(o, q, k, v, o, lse, device: :cpu)

      for {g, c} <- [{dq, dq_c}, {dk, dk_c}, {dv_grad, dv_c}] do
        assert Numeric.rel_err(g, c) < 1.0e-5
      end
    end
  end

  # Float64 attention over the lists of q [B, Sq, H, D], k [B, Sk, Hkv, D], v [B, Sk, Hkv, Dv]:
  # o [B, Sq, H, Dv] flattened; causal bottom-right, window {left, right} as the module doc says.
  defp reference(q, k, v, opts) do
    {b, sq, h, d} = q.shape
    {_, sk, hkv, _} = k.shape
    dv = elem(v.shape, 3)
    [q, k, v] = Enum.map([q, k, v], &(&1 |> Tensor.to_list() |> List.to_tuple()))
    scale = 1 / :math.sqrt(d)
    {left, right} = Keyword.get(opts, :window) || {nil, nil}
    right = if opts[:causal], do: min(right || 0, 0), else: right

    for bi <- 0..(b - 1), i <- 0..(sq - 1), hi <- 0..(h - 1), x <- 0..(dv - 1) do
      g = div(hi, div(h, hkv))
      diag = i + sk - sq

      keys =
        Enum.filter(0..(sk - 1), fn j ->
          (left == nil or j >= diag - left) and (right == nil or j <= diag + right)
        end)

      scores =
        for j <- keys do
          dot = Enum.reduce(0..(d - 1), 0.0, fn y, s -> s + elem(q, ((bi * sq + i) * h + hi) * d + y) * elem(k, ((bi * sk + j) * hkv + g) * d + y) end)
          {j, scale * dot}
        end

      case scores do
        [] ->
          0.0

        _ ->
          m = scores |> Enum.map(&elem(&1, 1)) |> Enum.max()
          weights = Enum.map(scores, fn {j, s} -> {j, :math.exp(s - m)} end)
          total = weights |> Enum.map(&elem(&1, 1)) |> Enum.sum()
          Enum.reduce(weights, 0.0, fn {j, p}, acc -> acc + p * elem(v, ((bi * sk + j) * hkv + g) * dv + x) end) / total
      end
    end
  end

  defp fd(%Tensor{} = x, f) do
    values = Tensor.to_list(x)

    for i <- 0..(length(values) - 1) do
      plus = Tensor.from_list(List.update_at(values, i, &(&1 + @h)), x.shape, x.type)
      minus = Tensor.from_list(List.update_at(values, i, &(&1 - @h)), x.shape, x.type)
      (f.(plus) - f.(minus)) / (2 * @h)
    end
  end
end
