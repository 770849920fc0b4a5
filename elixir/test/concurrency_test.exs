defmodule FlashNif.ConcurrencyTest do
  # Many processes call forward and backward at once, each on its own inputs (several dtypes and
  # shapes); every answer must equal, bit for bit, the one computed alone beforehand (the CPU
  # kernels are deterministic), so no call sees another's buffers or options.
  use ExUnit.Case, async: true

  alias ExPhil.Native.FlashAttention, as: FA
  alias FlashNif.Numeric

  @processes 48
  @calls_each 4

  test "#{@processes} processes x #{@calls_each} calls each get right answers" do
    jobs =
      for i <- 1..@processes do
        type = Enum.at([{:f, 32}, {:f, 16}, {:bf, 16}], rem(i, 3))

        {b, sq, sk, h, hkv, d} =
          {1 + rem(i, 2), 3 + rem(i * 7, 29), 5 + rem(i * 5, 23), 4, 1 + rem(i, 2) * 1, 8 * (1 + rem(i, 3))}

        opts = [causal: rem(i, 2) == 0, scale: 0.1 + i / 100]

        inputs =
          for {shape, s} <- [
                {{b, sq, h, d}, 1},
                {{b, sk, hkv, d}, 2},
                {{b, sk, hkv, d}, 3},
                {{b, sq, h, d}, 4}
              ],
              do: Numeric.random(shape, type, i * 10 + s)

        {inputs, opts}
      end

    expected = Enum.map(jobs, &run/1)

    results =
      jobs
      |> Task.async_stream(fn job -> for(_ <- 1..@calls_each, do: run(job)) end,
        max_concurrency: @processes,
        ordered: true,
        timeout: 60_000
      )
      |> Enum.map(fn {:ok, runs} -> runs end)

    for {want, runs} <- Enum.zip(expected, results), got <- runs do
      assert got == want
    end
  end

  test "every oracle fixture, 8 processes each, all at once, within tolerance" do
    cases = FlashNif.Fixtures.cases()

    cases
    |> Enum.flat_map(&List.duplicate(&1, 8))
    |> Task.async_stream(
      fn c ->
        t = c.tensors
        {:ok, o, lse} = FlashNif.Fixtures.forward(c, c.opts)

        {:ok, grads} =
          c |> FlashNif.Fixtures.backward(t.o_in, t.lse_in, c.opts) |> FlashNif.Fixtures.gradients()

        {c, [o: {o, t.o}, lse: {lse, t.lse}] ++ for({name, g} <- grads, do: {name, {g, Map.fetch!(t, name)}})}
      end,
      max_concurrency: 8 * length(cases),
      timeout: 60_000
    )
    |> Enum.each(fn {:ok, {c, pairs}} ->
      for {name, {got, want}} <- pairs do
        err = Numeric.rel_err(got, want)
        assert err <= c.tol[name], "#{c.name} #{name}: #{err} > #{c.tol[name]}"
      end
    end)
  end

  defp run({[q, k, v, d_out], opts}) do
    {:ok, o, lse} = FA.forward_with_states(q, k, v, opts)
    {:ok, dq, dk, dv} = FA.backward(d_out, q, k, v, o, lse, opts)
    {o.data, lse.data, dq.data, dk.data, dv.data}
  end
end
