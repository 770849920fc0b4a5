# ExPhil's attention shapes from Elixir: B = 1 and 64, S = 60 and 1024, H = 4, D = 64, f32,
# causal with a sliding window of 60 keys back (`window: {60, 0}`), next to plain causal for
# scale. Each call is one NIF call with host binaries in and out; "fwd+bwd" is
# forward_with_states/4 then backward/7. Median of several runs (at least --runs, and more while
# the --budget in seconds per cell lasts), after one warm-up call.
#
#     cd elixir && mix run ../bench/exphil.exs                  # CPU
#     cd elixir && mix run ../bench/exphil.exs --device cuda    # GPU machine
#
# RAYON_NUM_THREADS limits the CPU backend's threads (set it before the VM starts).

alias ExPhil.Native.FlashAttention, as: FA
alias ExPhil.Native.FlashAttention.Tensor

{opts, _, invalid} =
  OptionParser.parse(System.argv(), strict: [device: :string, runs: :integer, budget: :float])

if invalid != [],
  do:
    Mix.raise("unknown arguments #{inspect(invalid)}; use --device cpu|cuda|auto, --runs N, --budget SECONDS")

device =
  case Keyword.get(opts, :device, "cpu") do
    d when d in ["cpu", "cuda", "auto"] -> String.to_atom(d)
    d -> Mix.raise("--device must be cpu, cuda or auto, got #{d}")
  end

runs = Keyword.get(opts, :runs, 5)
budget = Keyword.get(opts, :budget, 2.0)
{heads, head_dim, window} = {4, 64, 60}

# Standard-normal values, one random block repeated (generating 67 MB element by element in
# Elixir would take longer than the benchmark).
block = for _ <- 1..4096, into: <<>>, do: <<:rand.normal()::float-32-native>>

tensor = fn shape ->
  n = Tensor.size(shape)
  %Tensor{data: binary_part(:binary.copy(block, div(n + 4095, 4096)), 0, n * 4), shape: shape, type: {:f, 32}}
end

# Median milliseconds of `fun` (which must return {:ok, ...}).
median_ms = fn fun ->
  {:ok, _} = fun.()
  start = System.monotonic_time(:microsecond)

  times =
    Enum.reduce_while(Stream.iterate(1, &(&1 + 1)), [], fn i, acc ->
      t0 = System.monotonic_time(:microsecond)
      {:ok, _} = fun.()
      acc = [System.monotonic_time(:microsecond) - t0 | acc]
      spent = (System.monotonic_time(:microsecond) - start) / 1.0e6
      if i >= runs and spent >= budget, do: {:halt, acc}, else: {:cont, acc}
    end)
    |> Enum.sort()

  {Enum.at(times, div(length(times), 2)) / 1000, length(times)}
end

IO.puts("ExPhil shapes, H = #{heads}, D = #{head_dim}, f32, device #{device}: #{FA.backend_info()}")
IO.puts("median ms per step (runs)")

IO.puts(
  String.pad_trailing("B    S     mask", 30) <>
    String.pad_leading("forward", 18) <> String.pad_leading("fwd+bwd", 18)
)

for b <- [1, 64],
    s <- [60, 1024],
    {label, mask} <- [{"causal", []}, {"causal, window #{window}", [window: {window, 0}]}] do
  shape = {b, s, heads, head_dim}
  {q, k, v, d_out} = {tensor.(shape), tensor.(shape), tensor.(shape), tensor.(shape)}
  opts = [causal: true, device: device] ++ mask

  forward = fn ->
    with {:ok, o, lse} <- FA.forward_with_states(q, k, v, opts), do: {:ok, {o, lse}}
  end

  step = fn ->
    with {:ok, o, lse} <- FA.forward_with_states(q, k, v, opts),
         {:ok, dq, dk, dv} <- FA.backward(d_out, q, k, v, o, lse, opts),
         do: {:ok, {dq, dk, dv}}
  end

  cell = fn {ms, n} -> String.pad_leading("#{:erlang.float_to_binary(ms, decimals: 2)} (#{n})", 18) end
  row = String.pad_trailing("#{b}", 5) <> String.pad_trailing("#{s}", 6) <> String.pad_trailing(label, 19)

  case forward.() do
    {:ok, _} -> IO.puts(row <> cell.(median_ms.(forward)) <> cell.(median_ms.(step)))
    {:error, {kind, message}} -> IO.puts(row <> "  #{kind}: #{message}")
  end
end
