defmodule ExPhil.Native.FlashAttention.Nif do
  @moduledoc false
  # The NIF stubs and their loading. Use ExPhil.Native.FlashAttention instead.
  #
  # Wire format (see native/flash-nif/src/tensor.rs and args.rs): a tensor goes in as
  # {data, [dim, ...], dtype_name} and comes out as {data, {dim, ...}}. A compute function takes
  # the list of its tensors, its masks (a map of mask tensors: :segment_ids => {seg_q, seg_k},
  # :seqused_k, :leftpad_k, :block_mask; or, varlen, the list [cu_seqlens_q, cu_seqlens_k]) and
  # the map of every option. Every call returns {:ok, ...} or {:error, {kind, message}}.
  #
  # Loading never fails the module: @on_load records why the library could not be used (missing,
  # unloadable, or stale) in :persistent_term and logs it, and status/0 reports it, so the public
  # API answers {:error, {:nif_not_loaded, message}} instead of an undefined-function crash.

  @on_load :load
  # Must equal NIF_API in native/flash-nif/src/lib.rs; bump both together.
  @nif_api 7
  @status_key {__MODULE__, :status}
  # The project's version is the Rust workspace's (see mix.exs), so it must equal the library's.
  @external_resource Path.expand("../../../../../Cargo.toml", __DIR__)
  @version Mix.Project.config()[:version]

  @doc false
  def load do
    path = library_path()

    status =
      if File.exists?(path <> ".so") do
        case :erlang.load_nif(String.to_charlist(path), 0) do
          :ok -> check_api()
          {:error, {reason, text}} -> {:error, "cannot load #{path}.so (#{reason}): #{text}"}
        end
      else
        {:error,
         "the flash_nif NIF library is missing (expected #{path}.so). Run `mix compile` in the " <>
           "flash_nif project (it builds native/flash-nif with cargo and copies it to priv/)."}
      end

    :persistent_term.put(@status_key, status)

    # Erlang's :logger, not Logger: on_load can run before the :logger application starts.
    with {:error, message} <- status do
      :logger.warning("ExPhil.Native.FlashAttention: " <> message)
    end

    :ok
  end

  @doc false
  # :ok, or {:error, message} saying why the NIF cannot be used.
  def status, do: :persistent_term.get(@status_key, {:error, "the NIF module was not loaded"})

  defp check_api do
    case nif_api() do
      {@nif_api, @version} ->
        :ok

      {api, version} ->
        {:error,
         "the NIF library in priv/ is stale: it is NIF API #{api}, version #{version}, but this " <>
           "module expects API #{@nif_api}, version #{@version}. Run `mix compile` to rebuild it."}
    end
  end

  defp library_path do
    dir =
      case :code.priv_dir(:flash_nif) do
        {:error, _} -> Path.expand("../../../../priv", __DIR__)
        dir -> List.to_string(dir)
      end

    Path.join(dir, "libflash_nif")
  end

  # Stubs, replaced by the NIF when it loads.
  def nif_api, do: :erlang.nif_error(:nif_not_loaded)
  def info, do: :erlang.nif_error(:nif_not_loaded)
  def forward(_tensors, _masks, _options), do: :erlang.nif_error(:nif_not_loaded)
  def backward(_tensors, _masks, _options), do: :erlang.nif_error(:nif_not_loaded)
  def varlen_forward(_tensors, _cu_seqlens, _options), do: :erlang.nif_error(:nif_not_loaded)
  def varlen_backward(_tensors, _cu_seqlens, _options), do: :erlang.nif_error(:nif_not_loaded)
  # Rotary: [x, cos, sin], positions (nil | integer | tensor), %{interleaved: _, device: _}.
  def rotary(_tensors, _positions, _options), do: :erlang.nif_error(:nif_not_loaded)
  def rotary_backward(_tensors, _positions, _options), do: :erlang.nif_error(:nif_not_loaded)
  # KV caches (native/flash-nif/src/kv.rs): a cache is a tensor or
  # {:quantized, values, scales, biases, bits, group_size}; lengths %{cache_seqlens: t,
  # leftpad_k: t} (each optional); options %{causal, scale, window, softcap, num_splits, device}.
  def quantize_kv(_x, _bits, _group_size), do: :erlang.nif_error(:nif_not_loaded)
  def dequantize_kv(_parts, _bits, _group_size), do: :erlang.nif_error(:nif_not_loaded)
  def merge_states(_o_parts, _lse_parts), do: :erlang.nif_error(:nif_not_loaded)
  def decode(_q, _k_cache, _v_cache, _lengths, _options), do: :erlang.nif_error(:nif_not_loaded)

  def debug_panic, do: :erlang.nif_error(:nif_not_loaded)
end
