# A decode loop over a 4-bit quantized KV cache, the way a generating model uses one: the cache is
# preallocated to its longest length, :cache_seqlens says how much of each batch row is filled,
# and each step quantizes the new token's key and value, writes them at the end of each row
# (ragged rows: prompts of 5 and 2 tokens), then attends its query over the cache.
#
# Each step is checked against forward_with_states over the dequantized cache with the keys past
# each row's length hidden (seqused_k): the same attention, computed the long way.
#
#     cd elixir && mix run examples/decode_loop.exs

alias ExPhil.Native.FlashAttention, as: FA
alias ExPhil.Native.FlashAttention.{QuantizedKV, Tensor}

:rand.seed(:exsss, {1, 2, 3})

random = fn shape ->
  Tensor.from_list(for(_ <- 1..Tensor.size(shape), do: :rand.normal()), shape, {:f, 32})
end

rel_err = fn a, b ->
  {num, den} =
    Enum.zip_reduce(Tensor.to_list(a), Tensor.to_list(b), {0.0, 0.0}, fn x, y, {n, d} ->
      {n + (x - y) * (x - y), d + y * y}
    end)

  :math.sqrt(num / den)
end

{batch, heads, kv_heads, head_dim, s_max} = {2, 8, 2, 64, 256}

# Room for 256 tokens in each row; nothing filled yet (a zero cache quantizes to zero codes).
empty =
  Tensor.from_list(
    List.duplicate(0.0, batch * s_max * kv_heads * head_dim),
    {batch, s_max, kv_heads, head_dim},
    {:f, 32}
  )

k_cache = FA.quantize_kv!(empty, bits: 4, group_size: 64)
v_cache = FA.quantize_kv!(empty, bits: 4, group_size: 64)

# Prefill: prompts written at position 0 (row 1 keeps 2 of its 5; the rest is overwritten).
prompt = fn -> FA.quantize_kv!(random.({batch, 5, kv_heads, head_dim}), bits: 4, group_size: 64) end

cache = %{
  k: QuantizedKV.put_seq(k_cache, 0, prompt.()),
  v: QuantizedKV.put_seq(v_cache, 0, prompt.()),
  lens: [5, 2]
}

step = fn cache, q, k_new, v_new ->
  # q {batch, 1, heads, head_dim}; k_new, v_new {batch, 1, kv_heads, head_dim}: this token's
  k = QuantizedKV.put_seq(cache.k, cache.lens, FA.quantize_kv!(k_new, bits: 4, group_size: 64))
  v = QuantizedKV.put_seq(cache.v, cache.lens, FA.quantize_kv!(v_new, bits: 4, group_size: 64))
  lens = Enum.map(cache.lens, &(&1 + 1))
  seqlens = Tensor.from_list(lens, {batch}, {:s, 32})
  {out, lse} = FA.decode!(q, k, v, cache_seqlens: seqlens)
  {out, lse, %{k: k, v: v, lens: lens}}
end

IO.puts("step  lengths    rel. error vs forward over the dequantized cache (o, lse)")

Enum.reduce(1..8, cache, fn i, cache ->
  q = random.({batch, 1, heads, head_dim})

  {out, lse, cache} =
    step.(cache, q, random.({batch, 1, kv_heads, head_dim}), random.({batch, 1, kv_heads, head_dim}))

  seqlens = Tensor.from_list(cache.lens, {batch}, {:s, 32})

  {want, want_lse} =
    FA.forward_with_states!(q, FA.dequantize_kv!(cache.k), FA.dequantize_kv!(cache.v), seqused_k: seqlens)

  e = {rel_err.(out, want), rel_err.(lse, want_lse)}

  [eo, el] = for x <- Tuple.to_list(e), do: :erlang.float_to_binary(x, scientific: 1)

  IO.puts(
    "#{String.pad_leading("#{i}", 4)}  #{String.pad_trailing(inspect(cache.lens, charlists: :as_lists), 9)}  #{eo}  #{el}"
  )

  true = elem(e, 0) < 1.0e-5 and elem(e, 1) < 1.0e-5
  cache
end)
