defmodule ExPhil.Native.FlashAttention.KV do
  @moduledoc false
  # quantize_kv/2, dequantize_kv/1, merge_states/2 and decode/4 behind ExPhil.Native.FlashAttention
  # (documented there): Python's flash_nif.kv with the same option names, defaults and errors.
  # Option types are checked here, in Elixir's terms; shapes, dtypes and values in the core.

  alias ExPhil.Native.FlashAttention.{Nif, Options, QuantizedKV}
  import ExPhil.Native.FlashAttention.Wire

  @max_i64 Options.max_i64()

  ## Quantized caches

  def quantize_kv(x, opts) do
    with {:ok, %{bits: bits, group_size: group_size}} <- quant_options(opts),
         {:ok, {_, dims, _} = wx} <- wire(x, :x),
         :ok <- loaded(),
         {:ok, values, scales, biases} <- Nif.quantize_kv(wx, bits, group_size) do
      type = type_of(x)

      {:ok,
       %QuantizedKV{
         values: result(x, values, {:u, 32}),
         scales: result(x, scales, type),
         biases: result(x, biases, type),
         bits: bits,
         group_size: group_size,
         shape: List.to_tuple(dims),
         type: type
       }}
    end
  end

  def dequantize_kv(%QuantizedKV{} = c) do
    with {:ok, parts} <- wire(values: c.values, scales: c.scales, biases: c.biases),
         {:ok, bits, group_size} <- format(c),
         :ok <- loaded(),
         {:ok, x} <- Nif.dequantize_kv(parts, bits, group_size) do
      {:ok, result(c.scales, x, type_of(c.scales))}
    end
  end

  def dequantize_kv(other) do
    {:error,
     {:argument,
      "dequantize_kv takes an ExPhil.Native.FlashAttention.QuantizedKV (from quantize_kv/2), " <>
        "got: #{short(other)}"}}
  end

  @quant_defaults %{bits: 4, group_size: 64}

  # %{bits:, group_size:}: non-negative integers here, 4 | 8 and 32 | 64 (dividing D) in the core.
  defp quant_options(opts) when is_list(opts) do
    Enum.reduce_while(opts, {:ok, @quant_defaults}, fn
      {key, v}, {:ok, acc} when key in [:bits, :group_size] ->
        case count(key, v) do
          {:ok, v} -> {:cont, {:ok, %{acc | key => v}}}
          error -> {:halt, error}
        end

      {key, _}, _ when is_atom(key) ->
        {:halt, unsupported("unknown option #{inspect(key)}; the options are [:bits, :group_size]")}

      other, _ ->
        {:halt, unsupported("options must be a keyword list, got the element #{inspect(other)}")}
    end)
  end

  defp quant_options(opts), do: unsupported("options must be a keyword list, got: #{inspect(opts)}")

  # A cache's bits and group size, as quant_options/1 takes them (a struct can be built by hand).
  defp format(%QuantizedKV{bits: bits, group_size: group_size}) do
    with {:ok, bits} <- count(:bits, bits),
         {:ok, group_size} <- count(:group_size, group_size),
         do: {:ok, bits, group_size}
  end

  defp count(_key, v) when is_integer(v) and v >= 0 and v <= @max_i64, do: {:ok, v}
  defp count(:bits, v), do: unsupported("bits must be 4 or 8, got: #{inspect(v)}")
  defp count(:group_size, v), do: unsupported("group_size must be 32 or 64, got: #{inspect(v)}")

  ## Merging partial states

  def merge_states(o_parts, lse_parts) do
    with {:ok, wo, form} <- stack(o_parts, "o_parts"),
         {:ok, wl, _} <- stack(lse_parts, "lse_parts"),
         :ok <- loaded(),
         {:ok, o, lse} <- Nif.merge_states(wo, wl) do
      {:ok, result(form, o, type_of(form)), result(form, lse, {:f, 32})}
    end
  end

  # {:ok, wired [P, ...] tensor, a part to take the result's form from}: a stacked tensor as is,
  # or a list of parts of one shape and type stacked (Python's np.stack). An empty list reaches
  # the core as a shape {0}, which it refuses with its message.
  defp stack([], _name), do: {:ok, {<<>>, [0], "float32"}, nil}

  defp stack([first | _] = parts, name) when is_list(parts) do
    named = parts |> Enum.with_index() |> Enum.map(fn {t, i} -> {"#{name}[#{i}]", t} end)

    with {:ok, [{_, dims, dtype} | _] = wired} <- wire(named) do
      case Enum.find(Enum.with_index(wired), fn {{_, d, t}, _} -> {d, t} != {dims, dtype} end) do
        nil ->
          {:ok, {IO.iodata_to_binary(Enum.map(wired, &elem(&1, 0))), [length(wired) | dims], dtype}, first}

        {{_, d, t}, i} ->
          kind = if d != dims, do: :shape, else: :dtype

          {:error,
           {kind,
            "#{name}[#{i}] is #{t} #{inspect(d)} but #{name}[0] is #{dtype} #{inspect(dims)}: " <>
              "the parts must have one shape and dtype"}}
      end
    end
  end

  defp stack(t, name) do
    with {:ok, w} <- wire(t, name), do: {:ok, w, t}
  end

  ## Decode

  # Python's decode keywords and defaults; device :cpu as every CPU-default call here.
  @decode_defaults %{
    causal: true,
    scale: nil,
    window: {nil, nil},
    softcap: nil,
    num_splits: nil,
    device: :cpu
  }
  @decode_keys [:cache_seqlens, :leftpad_k | Map.keys(@decode_defaults)]

  def decode(q, k_cache, v_cache, opts) do
    with {:ok, options, lengths} <- decode_options(opts),
         {:ok, wq} <- wire(q, :q),
         {:ok, wk} <- wire_cache(k_cache, "k_cache"),
         {:ok, wv} <- wire_cache(v_cache, "v_cache"),
         {:ok, lengths} <- wire_lengths(lengths),
         :ok <- loaded(),
         {:ok, o, lse} <- Nif.decode(wq, wk, wv, lengths, options) do
      {:ok, result(q, o, type_of(q)), result(q, lse, {:f, 32})}
    end
  end

  # {:ok, the NIF's options map, the length tensors given}.
  defp decode_options(opts) when is_list(opts) do
    Enum.reduce_while(opts, {:ok, @decode_defaults, []}, fn
      {key, t}, {:ok, o, lens} when key in [:cache_seqlens, :leftpad_k] ->
        {:cont, {:ok, o, if(t == nil, do: Keyword.delete(lens, key), else: Keyword.put(lens, key, t))}}

      {key, v}, {:ok, o, lens} when key in @decode_keys ->
        case decode_option(key, v) do
          {:ok, v} -> {:cont, {:ok, %{o | key => v}, lens}}
          error -> {:halt, error}
        end

      {key, _}, _ when is_atom(key) ->
        {:halt, unsupported("unknown option #{inspect(key)}; the options are #{inspect(@decode_keys)}")}

      other, _ ->
        {:halt, unsupported("options must be a keyword list, got the element #{inspect(other)}")}
    end)
  end

  defp decode_options(opts), do: unsupported("options must be a keyword list, got: #{inspect(opts)}")

  defp decode_option(:num_splits, n) when is_nil(n) or (is_integer(n) and n >= 0 and n <= @max_i64),
    do: {:ok, n}

  defp decode_option(:num_splits, n),
    do: unsupported("the :num_splits option must be a positive integer or nil, got: #{inspect(n)}")

  defp decode_option(key, v), do: Options.option(key, v)

  defp wire_cache(%QuantizedKV{} = c, name) do
    parts = for part <- [:values, :scales, :biases], do: {"#{name}.#{part}", Map.fetch!(c, part)}

    with {:ok, [v, s, b]} <- wire(parts),
         {:ok, bits, group_size} <- format(c),
         do: {:ok, {:quantized, v, s, b, bits, group_size}}
  end

  defp wire_cache(t, name), do: wire(t, name)

  defp wire_lengths(lengths) do
    with {:ok, wired} <- wire(lengths), do: {:ok, Map.new(Enum.zip(Keyword.keys(lengths), wired))}
  end
end
