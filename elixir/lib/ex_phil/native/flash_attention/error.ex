defmodule ExPhil.Native.FlashAttention.Error do
  @moduledoc """
  Raised by the `!` functions of `ExPhil.Native.FlashAttention`; `kind` and `message` are the
  two halves of the `{:error, {kind, message}}` reason the non-raising functions return.
  """
  defexception [:kind, :message]

  @impl true
  def message(%__MODULE__{kind: kind, message: message}), do: "(#{kind}) #{message}"
end
