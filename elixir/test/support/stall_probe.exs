# Run by test/scheduler_test.exs in a fresh VM started with `+S 1` (one normal scheduler):
#
#     elixir --erl "+S 1" -pa <flash_nif ebin> test/support/stall_probe.exs TARGET_SECONDS
#
# Sizes a backward call to take about TARGET_SECONDS, runs it while a ticking process on the
# normal scheduler wakes up every millisecond, and prints one line, "STALL_PROBE <base64 term>",
# with the call's duration and the ticker's worst wake-up delay (and the same delay measured
# with no call running, as a baseline). A NIF that held the only normal scheduler would delay
# the ticker by the whole call.

alias ExPhil.Native.FlashAttention, as: FA
alias ExPhil.Native.FlashAttention.Tensor

defmodule Ticker do
  # Sleeps 1 ms at a time and keeps the worst lateness (wake-up time minus the requested 1 ms).
  def start, do: spawn_link(fn -> loop(now(), 0, 0) end)

  def stop(pid) do
    send(pid, {:stop, self()})
    receive do: ({:ticker, worst_us, ticks} -> {worst_us, ticks})
  end

  defp loop(last, worst, ticks) do
    receive do
      {:stop, from} -> send(from, {:ticker, worst, ticks})
    after
      1 ->
        t = now()
        loop(t, max(worst, t - last - 1000), ticks + 1)
    end
  end

  defp now, do: System.monotonic_time(:microsecond)
end

[target] = System.argv()
target = String.to_float(target)
1 = :erlang.system_info(:schedulers_online)

# Inputs: a block of random normals repeated (generating megabytes element by element in Elixir
# would dominate the run; the values do not matter for timing).
block = for _ <- 1..4096, into: <<>>, do: <<:rand.normal()::float-32-native>>

tensor = fn shape ->
  n = Tensor.size(shape)
  data = binary_part(:binary.copy(block, div(n + 4095, 4096)), 0, n * 4)
  %Tensor{data: data, shape: shape, type: {:f, 32}}
end

{b, h, d} = {1, 8, 64}

backward_at = fn s ->
  q = tensor.({b, s, h, d})
  k = tensor.({b, s, h, d})
  {:ok, o, lse} = FA.forward_with_states(q, k, k)
  {micros, {:ok, _, _, _}} = :timer.tc(fn -> FA.backward(o, q, k, k, o, lse) end)
  {micros / 1.0e6, {q, k, o, lse}}
end

# Cost grows as seq^2: calibrate at 2048, then size the real call for the target duration.
{t0, _} = backward_at.(2048)
s = min(32_768, max(2048, round(2048 * :math.sqrt(target / max(t0, 1.0e-4)) / 64) * 64))
q = tensor.({b, s, h, d})
k = tensor.({b, s, h, d})
{:ok, o, lse} = FA.forward_with_states(q, k, k)

ticker = Ticker.start()
Process.sleep(1000)
{baseline_us, baseline_ticks} = Ticker.stop(ticker)

ticker = Ticker.start()
Process.sleep(20)
{micros, {:ok, _, _, _}} = :timer.tc(fn -> FA.backward(o, q, k, k, o, lse) end)
{worst_us, ticks} = Ticker.stop(ticker)

result = %{
  seq: s,
  shape: {b, s, h, d},
  backward_s: micros / 1.0e6,
  worst_tick_delay_ms: worst_us / 1000,
  ticks: ticks,
  baseline_worst_tick_delay_ms: baseline_us / 1000,
  baseline_ticks: baseline_ticks,
  schedulers: :erlang.system_info(:schedulers_online),
  dirty_cpu_schedulers: :erlang.system_info(:dirty_cpu_schedulers_online),
  logical_processors: :erlang.system_info(:logical_processors_available)
}

IO.puts("STALL_PROBE " <> Base.encode64(:erlang.term_to_binary(result)))
