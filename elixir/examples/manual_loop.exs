# A training loop stitched by hand through the NIF, the way ExPhil uses it (Nx autodiff cannot
# cross a NIF): forward_with_states -> loss on the output -> backward -> parameter update.
#
# Toy objective: a "teacher" attention layer with hidden q*, k*, v* produces target outputs; a
# student starts from other random q, k, v and learns to reproduce them by gradient descent on
# the mean squared error. Arithmetic on the tiny tensors is plain Elixir on lists.
#
#     cd elixir && mix run examples/manual_loop.exs

alias ExPhil.Native.FlashAttention, as: FA
alias ExPhil.Native.FlashAttention.Tensor

defmodule Toy do
  def random(shape, scale \\ 1.0) do
    values = for _ <- 1..Tensor.size(shape), do: scale * :rand.normal()
    Tensor.from_list(values, shape, {:f, 32})
  end

  # Mean squared error and its gradient with respect to the output (the backward's d_out).
  def mse(%Tensor{} = out, %Tensor{} = target) do
    diffs = Enum.zip_with(Tensor.to_list(out), Tensor.to_list(target), &(&1 - &2))
    n = length(diffs)
    loss = Enum.reduce(diffs, 0.0, &(&1 * &1 + &2)) / n
    {loss, Tensor.from_list(Enum.map(diffs, &(2 * &1 / n)), out.shape, out.type)}
  end

  # Plain gradient descent: x - lr * grad.
  def step(%Tensor{} = x, %Tensor{} = grad, lr) do
    values = Enum.zip_with(Tensor.to_list(x), Tensor.to_list(grad), &(&1 - lr * &2))
    Tensor.from_list(values, x.shape, x.type)
  end
end

:rand.seed(:exsss, {7, 8, 9})

# q [batch, seq, heads, head_dim]; k, v [batch, seq, kv_heads, head_dim] (GQA: 4 heads, 2 kv heads)
q_shape = {2, 12, 4, 8}
kv_shape = {2, 12, 2, 8}
opts = [causal: true]

teacher = %{q: Toy.random(q_shape), k: Toy.random(kv_shape), v: Toy.random(kv_shape)}
target = FA.forward!(teacher.q, teacher.k, teacher.v, opts)

params = %{q: Toy.random(q_shape), k: Toy.random(kv_shape), v: Toy.random(kv_shape)}
lr = 6.0
steps = 300

IO.puts("step   loss")

final =
  Enum.reduce(0..steps, params, fn step, p ->
    {out, lse} = FA.forward_with_states!(p.q, p.k, p.v, opts)
    {loss, d_out} = Toy.mse(out, target)
    {dq, dk, dv} = FA.backward!(d_out, p.q, p.k, p.v, out, lse, opts)

    if rem(step, 25) == 0, do: IO.puts(String.pad_leading("#{step}", 4) <> "   #{Float.round(loss, 6)}")

    %{q: Toy.step(p.q, dq, lr), k: Toy.step(p.k, dk, lr), v: Toy.step(p.v, dv, lr)}
  end)

{loss, _} = Toy.mse(FA.forward!(final.q, final.k, final.v, opts), target)
IO.puts("final loss #{Float.round(loss, 6)}")
