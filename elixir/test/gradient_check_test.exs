defmodule FlashNif.GradientCheckTest do
  # backward/7 against central finite differences of forward/4 on tiny cases: for the loss
  # L = sum(o * w), dL/do = w, and every entry of dq, dk and dv is compared with
  # (L(x + h) - L(x - h)) / 2h. f32 with h = 1e-2: truncation and round-off both stay near 1e-4.
  use ExUnit.Case, async: true

  alias ExPhil.Native.FlashAttention, as: FA
  alias ExPhil.Native.FlashAttention.Tensor
  alias FlashNif.Numeric

  @h 1.0e-2

  for {label, opts, dims} <- [
        {"causal GQA, Sq < Sk", [causal: true], {1, 3, 4, 2, 1, 4}},
        {"full attention, Sq > Sk, explicit scale", [causal: false, scale: 0.7], {2, 3, 2, 2, 2, 3}},
        {"causal, Sq > Sk (a row that sees no key)", [causal: true], {1, 3, 2, 2, 1, 2}},
        {"two-sided window, Sq < Sk", [causal: false, window: {1, 0}], {1, 3, 4, 2, 1, 4}},
        # Row 2 (id 1) finds no id-1 key among the first seqused_k = 3: it sees nothing.
        {"segment ids and padding",
         [
           causal: false,
           segment_ids:
             {Tensor.from_list([0, 0, 1], {1, 3}, {:s, 32}), Tensor.from_list([0, 0, 0, 1], {1, 4}, {:s, 32})},
           seqused_k: Tensor.from_list([3], {1}, {:s, 32}),
           leftpad_k: Tensor.from_list([1], {1}, {:s, 32})
         ], {1, 3, 4, 2, 1, 4}}
      ] do
    test "gradients match finite differences: #{label}" do
      {b, sq, sk, h, hkv, d} = unquote(Macro.escape(dims))
      opts = unquote(Macro.escape(opts))
      q = Numeric.random({b, sq, h, d}, {:f, 32}, 1)
      k = Numeric.random({b, sk, hkv, d}, {:f, 32}, 2)
      v = Numeric.random({b, sk, hkv, d}, {:f, 32}, 3)
      w = Numeric.random({b, sq, h, d}, {:f, 32}, 4)

      {:ok, o, lse} = FA.forward_with_states(q, k, v, opts)
      {:ok, dq, dk, dv} = FA.backward(w, q, k, v, o, lse, opts)

      loss = fn q, k, v ->
        o = FA.forward!(q, k, v, opts)
        Enum.zip(Tensor.to_list(o), Tensor.to_list(w)) |> Enum.reduce(0.0, fn {a, b}, s -> s + a * b end)
      end

      numeric = %{
        dq: fd(q, &loss.(&1, k, v)),
        dk: fd(k, &loss.(q, &1, v)),
        dv: fd(v, &loss.(q, k, &1))
      }

      for {name, analytic} <- [dq: dq, dk: dk, dv: dv] do
        err = Numeric.rel_err(Tensor.to_list(analytic), numeric[name])
        assert err < 2.0e-3, "#{name}: relative error #{err} against finite differences"
      end
    end
  end

  test "dlse: gradients of sum(o * w) + sum(lse * g) match finite differences" do
    # causal, Sq > Sk: row 0 sees no key (lse = -inf), and its dlse is ignored.
    {b, sq, sk, h, hkv, d} = {1, 3, 2, 2, 1, 3}
    q = Numeric.random({b, sq, h, d}, {:f, 32}, 11)
    k = Numeric.random({b, sk, hkv, d}, {:f, 32}, 12)
    v = Numeric.random({b, sk, hkv, d}, {:f, 32}, 13)
    w = Numeric.random({b, sq, h, d}, {:f, 32}, 14)
    g = Numeric.random({b, h, sq}, {:f, 32}, 15)

    {:ok, o, lse} = FA.forward_with_states(q, k, v)
    {:ok, dq, dk, dv} = FA.backward(w, q, k, v, o, lse, dlse: g)
    {:ok, plain_dq, _, _} = FA.backward(w, q, k, v, o, lse, dlse: nil)
    assert Tensor.to_list(plain_dq) != Tensor.to_list(dq)

    dot = fn xs, ys -> Enum.zip(xs, ys) |> Enum.reduce(0.0, fn {a, b}, s -> if is_number(a), do: s + a * b, else: s end) end

    loss = fn q, k, v ->
      {:ok, o, lse} = FA.forward_with_states(q, k, v)
      dot.(Tensor.to_list(o), Tensor.to_list(w)) + dot.(Tensor.to_list(lse), Tensor.to_list(g))
    end

    numeric = %{dq: fd(q, &loss.(&1, k, v)), dk: fd(k, &loss.(q, &1, v)), dv: fd(v, &loss.(q, k, &1))}

    for {name, analytic} <- [dq: dq, dk: dk, dv: dv] do
      err = Numeric.rel_err(Tensor.to_list(analytic), numeric[name])
      assert err < 2.0e-3, "#{name}: relative error #{err} against finite differences"
    end

    assert {:error, {:shape, message}} = FA.backward(w, q, k, v, o, lse, dlse: w)
    assert message =~ "dlse has shape"
    assert {:error, {:unsupported, _}} = FA.forward(q, k, v, dlse: g)
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
end
