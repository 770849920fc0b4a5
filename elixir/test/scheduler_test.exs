defmodule FlashNif.SchedulerTest do
  # With one normal scheduler (+S 1), a multi-second backward must not stall other processes:
  # it runs on a dirty CPU scheduler. Measured in a fresh VM by test/support/stall_probe.exs.
  use ExUnit.Case, async: false

  @moduletag :slow
  @moduletag timeout: 300_000
  @target_seconds 3.0
  # The ticker sleeps 1 ms at a time; a stall delays it by the whole call. The allowance, a
  # quarter of the call, covers OS time-slicing on a small shared machine, where the kernel
  # threads occupy every core while the scheduler thread wants one too (CI's 2-core VM once
  # delayed it by 136 ms during a 2.2 s call).
  @max_delay_fraction 0.25

  test "a multi-second backward leaves the only normal scheduler free (+S 1)" do
    ebin = Path.join(:code.lib_dir(:flash_nif), "ebin")
    probe = Path.expand("support/stall_probe.exs", __DIR__)
    elixir = System.find_executable("elixir")

    {out, status} =
      System.cmd(elixir, ["--erl", "+S 1", "-pa", ebin, probe, Float.to_string(@target_seconds)],
        stderr_to_stdout: true
      )

    assert status == 0, out
    [_, encoded] = Regex.run(~r/STALL_PROBE (\S+)/, out)
    r = encoded |> Base.decode64!() |> :erlang.binary_to_term()

    IO.puts(
      "\n+S 1 (dirty CPU schedulers: #{r.dirty_cpu_schedulers}, cores: #{r.logical_processors}): " <>
        "backward #{inspect(r.shape)} took #{Float.round(r.backward_s, 2)} s; a 1 ms ticker's worst " <>
        "delay was #{r.worst_tick_delay_ms} ms over #{r.ticks} ticks " <>
        "(#{r.baseline_worst_tick_delay_ms} ms over #{r.baseline_ticks} ticks with nothing running)"
    )

    assert r.schedulers == 1
    assert r.backward_s >= 1.0, "the backward was too short to show a stall: #{inspect(r)}"
    assert r.worst_tick_delay_ms < @max_delay_fraction * r.backward_s * 1000, inspect(r)
    # The ticker kept its pace through the call (at least half its idle rate, per second).
    assert r.ticks / r.backward_s >= 0.5 * r.baseline_ticks, inspect(r)
  end
end
