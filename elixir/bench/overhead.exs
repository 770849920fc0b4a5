# Per-call time of the NIF, to compare with the same calls from Python (bench/overhead.py, same
# shapes): the difference is the binding's overhead (argument checks, dirty-scheduler hop,
# output binaries) since both call the same flash-core functions.
#
#     cd elixir && mix run bench/overhead.exs

alias ExPhil.Native.FlashAttention, as: FA
alias ExPhil.Native.FlashAttention.Tensor

shapes = [
  {1, 1, 1, 8},
  {1, 16, 2, 32},
  {1, 128, 4, 64},
  {2, 512, 8, 64},
  {1, 2048, 8, 64}
]

block = for _ <- 1..4096, into: <<>>, do: <<:rand.normal()::float-32-native>>

tensor = fn shape ->
  n = Tensor.size(shape)
  %Tensor{data: binary_part(:binary.copy(block, div(n + 4095, 4096)), 0, n * 4), shape: shape, type: {:f, 32}}
end

# Median seconds per call over at least 5 calls and about `budget` seconds.
median = fn fun, budget ->
  for _ <- 1..3, do: fun.()
  start = System.monotonic_time()

  times =
    Stream.repeatedly(fn ->
      t0 = System.monotonic_time()
      fun.()
      System.monotonic_time() - t0
    end)
    |> Enum.reduce_while([], fn t, acc ->
      elapsed = System.convert_time_unit(System.monotonic_time() - start, :native, :microsecond) / 1.0e6

      if (length(acc) >= 5 and elapsed > budget) or length(acc) >= 20_000,
        do: {:halt, [t | acc]},
        else: {:cont, [t | acc]}
    end)
    |> Enum.sort()

  System.convert_time_unit(Enum.at(times, div(length(times), 2)), :native, :nanosecond) / 1.0e9
end

IO.puts("shape [B, S, H, D] (causal, f32)   forward_with_states   backward")

for {b, s, h, d} = shape <- shapes do
  q = tensor.(shape)
  k = tensor.({b, s, h, d})
  {:ok, o, lse} = FA.forward_with_states(q, k, k)
  fwd = median.(fn -> {:ok, _, _} = FA.forward_with_states(q, k, k) end, 1.0)
  bwd = median.(fn -> {:ok, _, _, _} = FA.backward(o, q, k, k, o, lse) end, 1.0)

  IO.puts(
    String.pad_trailing(inspect(shape), 34) <>
      String.pad_leading("#{Float.round(fwd * 1.0e6, 1)} us", 20) <>
      String.pad_leading("#{Float.round(bwd * 1.0e6, 1)} us", 12)
  )
end
