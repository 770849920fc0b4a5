defmodule ExPhil.Native.FlashAttention.Options do
  @moduledoc false
  # The values of the options every call shares (causal, scale, device, deterministic, mode,
  # precision, window, softcap): their types are checked here, with messages in Elixir's terms; their values
  # (scale > 0, softcap range) in the core.

  import ExPhil.Native.FlashAttention.Wire, only: [unsupported: 1]

  @devices [:auto, :cpu, :cuda]
  @modes [:auto, :fused, :materialized]
  @precisions [:exact, :tf32]
  @max_i64 0x7FFFFFFFFFFFFFFF

  # The largest integer the core takes (an i64).
  def max_i64, do: @max_i64

  # One option's value as the NIF takes it, or the :unsupported error naming what it takes.
  def option(:causal, c) when is_boolean(c), do: {:ok, c}
  def option(:scale, s) when is_float(s) or is_nil(s), do: {:ok, s}
  def option(:scale, s) when is_integer(s) and abs(s) < 1.0e300, do: {:ok, s * 1.0}
  def option(:device, d) when d in @devices, do: {:ok, d}
  def option(:deterministic, x) when is_boolean(x), do: {:ok, x}
  def option(:mode, m) when m in @modes, do: {:ok, m}
  def option(:precision, p) when p in @precisions, do: {:ok, p}
  def option(:window, nil), do: {:ok, {nil, nil}}
  def option(:softcap, c) when is_float(c) or is_nil(c), do: {:ok, c}
  def option(:softcap, c) when is_integer(c) and abs(c) < 1.0e300, do: {:ok, c * 1.0}

  def option(:window, {left, right} = w) do
    if side?(left) and side?(right),
      do: {:ok, {side(left), side(right)}},
      else: window_error(w)
  end

  def option(:causal, c), do: unsupported("the :causal option must be true or false, got: #{inspect(c)}")

  def option(:scale, s),
    do: unsupported("the :scale option must be a positive number or nil, got: #{inspect(s)}")

  def option(:device, d),
    do: unsupported("the :device option must be :auto, :cpu or :cuda, got: #{inspect(d)}")

  def option(:deterministic, x),
    do: unsupported("the :deterministic option must be true or false, got: #{inspect(x)}")

  def option(:mode, m),
    do: unsupported("the :mode option must be :auto, :fused or :materialized, got: #{inspect(m)}")

  def option(:precision, p),
    do: unsupported("the :precision option must be :exact or :tf32, got: #{inspect(p)}")

  def option(:window, w), do: window_error(w)

  def option(:softcap, c),
    do: unsupported("the :softcap option must be a positive number or nil, got: #{inspect(c)}")

  defp window_error(w) do
    unsupported(
      "the :window option must be {left, right}, each a non-negative integer or :infinity " <>
        "(or nil for no window), got: #{inspect(w)}"
    )
  end

  # :infinity (unbounded) travels as nil; larger integers than the core's i64 are refused.
  defp side?(x), do: x == :infinity or (is_integer(x) and x >= 0 and x <= @max_i64)
  defp side(:infinity), do: nil
  defp side(x), do: x
end
