defmodule ExPhil.Native.FlashAttention do
  @moduledoc """
  Exact FlashAttention forward and backward passes, computed natively (Rust, flash-core) through
  a NIF on a dirty CPU scheduler, for training loops written by hand: Nx autodiff cannot cross a
  NIF, so the forward saves the row log-sum-exp and `backward/7` turns an output gradient into
  gradients for q, k and v.

  ## Tensors

  | tensor               | shape                         | type                              |
  |----------------------|-------------------------------|-----------------------------------|
  | `q`, `dq`            | `{batch, seq_q, heads, head_dim}` | `{:f, 32}`, `{:f, 16}` or `{:bf, 16}` |
  | `k`, `dk`            | `{batch, seq_k, kv_heads, head_dim}` | same as `q`                |
  | `v`, `dv`            | `{batch, seq_k, kv_heads, head_dim_v}` | same as `q`              |
  | `output`, `d_out`    | `{batch, seq_q, heads, head_dim_v}` | same as `q`                |
  | `logsumexp`          | `{batch, heads, seq_q}`       | always `{:f, 32}`                 |
  | `:segment_ids`       | `{seg_q, seg_k}`: `{batch, seq_q}`, `{batch, seq_k}` | `{:s, 32}` |
  | `:seqused_k`, `:leftpad_k` | `{batch}`               | `{:s, 32}`                        |
  | `:block_mask`        | `{batch or 1, heads or 1, ceil(seq_q / 128), ceil(seq_k / 128)}` | `{:u, 8}` |
  | `:alibi_slopes`      | `{heads}` or `{batch, heads}` | `{:f, 32}`                        |
  | `:sinks`, `dsinks`   | `{heads}`                     | `{:f, 32}`                        |

  `head_dim` and `head_dim_v` are each any size from 1 to 256, on the CPU and the GPU; `v` may have
  its own `head_dim_v` (DeepSeek-style attention: 192 for `q` and `k`, 128 for `v`), which the
  output takes.

  A varlen call (`varlen_forward_with_states/6`, `varlen_backward/9`) packs its sequences
  instead: `q`, `dq` are `{total_q, heads, head_dim}`, `output`, `d_out` `{total_q, heads,
  head_dim_v}`, `k`, `dk` `{total_k, kv_heads, head_dim}`, `v`, `dv` `{total_k, kv_heads,
  head_dim_v}`, `logsumexp` `{heads, total_q}`, and `cu_seqlens_q`,
  `cu_seqlens_k` are `{:s, 32}` `{batch + 1}` (0, then running totals: non-decreasing, ending
  at `total_q` and `total_k`).

  A tensor is an `ExPhil.Native.FlashAttention.Tensor` (a binary, native-endian and row-major,
  with a shape and a type) or, when Nx is loaded, an `Nx.Tensor`; results take the form of `q`
  (Nx tensors when `q` is one, on Nx's default backend). `heads` must be a multiple of `kv_heads`
  (grouped-query / multi-query attention); `dk` and `dv` sum over each group. Arithmetic is f32
  whatever the storage type; gradients come back in the input type.

  ## Options

    * `:causal` — mask future keys (default `true`). With `seq_q != seq_k` the mask is aligned
      bottom-right: query `i` sees keys `j <= i + seq_k - seq_q`. A row that sees no key (here
      or by any mask below) gives output 0, logsumexp `:neg_infinity` and zero gradients, never
      NaN.
    * `:scale` — softmax scale, a positive number (default `1 / sqrt(head_dim)`, `q` and `k`'s
      head dim).
    * `:device` — `:cpu` (default, like NumPy arrays in the Python API), `:cuda` (an error when
      no GPU backend is available; never a silent CPU run) or `:auto` (the GPU when the library
      has its CUDA backend and a GPU is present, else the CPU).
    * `:deterministic` — backward only (the forward accepts and ignores it); default `false`. The
      CPU backward is always bit-identical run to run. On the GPU the default sums `dq` with f32
      atomics (faster; `dq` may differ in its last bits between runs, `dk` and `dv` never do);
      `true` takes the atomic-free path.
    * `:mode` — `:auto` (default), `:fused` (tiled online softmax, O(seq) memory) or
      `:materialized` (each head's whole `seq_q × seq_k` score matrix; fastest for short
      sequences such as ExPhil's 60). `:auto` takes the materialized path where its score
      matrices fit `FLASH_NIF_MATERIALIZE_MAX_BYTES` (default 1 GiB) and the measured crossover
      table says it is faster. Both give the same results to the same bounds; the environment
      variable `FLASH_NIF_MODE` overrides the option. `:materialized` over that ceiling, or with
      `device: :cuda` (the GPU has fused kernels only), is an `:unsupported` error.
    * `:precision` — how `{:f, 32}` products are computed on the GPU: `:exact` (default) keeps
      f32 accuracy whichever kernel runs (the forward as split products on tensor cores from
      16 keys on: each operand the sum of two 11-bit parts, three products per pair summed in
      f32 — on Hopper at head dims 64 and 128 the wgmma kernel on fp16 parts of power-of-two-scaled
      tiles, elsewhere TF32 parts; the backward likewise on fp16 parts on Hopper at head dims 64
      and 128 without masks or modifiers; f32 FMAs below 16 keys, at head dims 64
      and 128 off Hopper, and in the other backwards); `:tf32` (asked for by name only) one
      TF32 product per pair (on Hopper's kernels one product of scaled fp16 operands, the same
      11 bits), forward and backward, faster, relative errors of order 1e-3 (bound
      5e-3 of ‖x - exact‖ / ‖exact‖ for o, lse and the gradients). The CPU always computes in f32
      and accepts either; `{:f, 16}` / `{:bf, 16}` are unaffected. `info/0` says which kernel
      ran and its `math`.
    * `:window` — `{left, right}`, each a non-negative integer or `:infinity` (unbounded): query
      `i` sees keys `j` with `i + off - left <= j <= i + off + right`, `off = seq_k - seq_q`
      (bottom-right, like `:causal`, which caps `right` at 0). ExPhil's sliding window,
      `causal: true, window: {60, 0}`, lets each query see itself and the 60 keys before it.
    * `:segment_ids` — `{seg_q, seg_k}`: query `i` of batch row `b` sees key `j` only when
      `seg_q[b][i] == seg_k[b][j]` (several documents packed in one row).
    * `:seqused_k`, `:leftpad_k` — per batch row, the valid keys are
      `leftpad_k[b] <= j < seqused_k[b]` (defaults 0 and `seq_k`; `0 <= leftpad_k[b] <=
      seqused_k[b] <= seq_k`); `:causal` and `:window` then count from those keys:
      `off = seqused_k[b] - leftpad_k[b] - seq_q` and key `j` sits at `j - leftpad_k[b]`.
    * `:block_mask` — 0 hides a whole block of 128 queries × 128 keys (block `{m, n}`: queries
      `128m..128m+127`, keys `128n..128n+127`) for that batch row and head; a size-1 batch or
      head axis applies to all.

  Masks intersect: a key is seen only if every mask given allows it.

  Score modifiers, applied to each score `s = scale * q·k` in this order, then the masks, then
  the softmax (the same names and rules as the Python API):

    * `:softcap` — a positive number `c`: `s = c * tanh(s / c)` (Gemma 2).
    * `:alibi_slopes` — `{heads}` or `{batch, heads}` `{:f, 32}`: `s -= slope * |i + off - j|`,
      with the masks' `off` and key position (FlashAttention's ALiBi).
    * `:sinks` — `{heads}` `{:f, 32}` (learnable, as in gpt-oss): one more logit per head in every
      row's softmax denominator, with no value: `logsumexp = log(Σ exp(s) + exp(sink))`. The
      backward then returns `{:ok, dq, dk, dv, dsinks}`, `dsinks` `{heads}` `{:f, 32}` summed
      over batch rows and query rows. A row that sees no key gets output 0, logsumexp `sink`.

  `nil` for any mask or modifier option is the same as leaving it out. A varlen call takes
  `:causal`, `:scale`, `:device`, `:deterministic`, `:mode`, `:precision`, `:window` (aligned within each
  sequence) and the modifiers (`:alibi_slopes` `{batch, heads}` counts sequences), not the mask
  tensors. Pass the same options to the forward and the backward of one step.

  ## Errors

  Every function returns `{:error, {kind, message}}` on failure, and the process that called it
  lives on (a panic in native code comes back as an `:internal` error). `message` is readable;
  `kind` is one of:

    * `:argument` — an argument is not a tensor (or its `data` is not a binary), or is a
      vectorized Nx tensor;
    * `:shape` — wrong rank, mismatched sizes (mask tensors included), a binary whose size does
      not match its shape and type, a shape that is not a tuple of non-negative integers,
      `:seqused_k` or `:leftpad_k` values outside `[0, seq_k]` or a `leftpad_k` past its
      `seqused_k`, `cu_seqlens` that do not start at 0, decrease, or do not end at the packed
      row count;
    * `:dtype` — an unsupported type (masks included: ids and lengths `{:s, 32}`, block masks
      `{:u, 8}`; slopes and sinks `{:f, 32}`), or tensors that should share a type do not;
    * `:unsupported` — a bad option (unknown key, wrong value type, negative window side,
      non-positive scale, a softcap outside `[1.0e-30, 1.0e30]`, a slope or sink that is not
      finite or past `1.0e30` in magnitude, a mask tensor given to a varlen call);
    * `:out_of_memory` — the outputs cannot be allocated;
    * `:cuda_unavailable`, `:cuda`, `:nvrtc` — GPU backend problems;
    * `:internal` — a bug (including a caught panic);
    * `:nif_not_loaded` — the native library is missing, cannot be loaded, or is stale
      (the message says which; `mix compile` rebuilds it).

  The `!` variants return the bare result and raise `ExPhil.Native.FlashAttention.Error`.

  ## Example

      iex> alias ExPhil.Native.FlashAttention.Tensor
      iex> q = Tensor.from_list([1.0, 0.0], {1, 1, 1, 2}, {:f, 32})
      iex> kv = Tensor.from_list([1.0, 2.0, 3.0, 4.0], {1, 2, 1, 2}, {:f, 32})
      iex> {:ok, out} = ExPhil.Native.FlashAttention.forward(q, kv, kv, causal: false, scale: 1.0e-9)
      iex> out.shape
      {1, 1, 1, 2}
      iex> Tensor.to_list(out) |> Enum.map(&Float.round(&1, 4))
      [2.0, 3.0]

  ## Masks, by example

  With one head of size 1, `q = k = v` and a scale near 0, every seen key weighs the same, so
  each output is the mean of the values its query sees.

  A window: with `causal: true, window: {1, 0}` query `i` sees keys `i - 1` and `i`.

      iex> alias ExPhil.Native.FlashAttention, as: FA
      iex> x = FA.Tensor.from_list([1.0, 2.0, 3.0, 4.0], {1, 4, 1, 1}, {:f, 32})
      iex> {:ok, out} = FA.forward(x, x, x, causal: true, window: {1, 0}, scale: 1.0e-9)
      iex> FA.Tensor.to_list(out) |> Enum.map(&Float.round(&1, 4))
      [1.0, 1.5, 2.5, 3.5]

  Segment ids: two documents packed in one row, each attending to itself only.

      iex> alias ExPhil.Native.FlashAttention, as: FA
      iex> x = FA.Tensor.from_list([1.0, 2.0, 3.0, 4.0], {1, 4, 1, 1}, {:f, 32})
      iex> ids = FA.Tensor.from_list([0, 0, 1, 1], {1, 4}, {:s, 32})
      iex> {:ok, out} = FA.forward(x, x, x, causal: false, segment_ids: {ids, ids}, scale: 1.0e-9)
      iex> FA.Tensor.to_list(out) |> Enum.map(&Float.round(&1, 4))
      [1.5, 1.5, 3.5, 3.5]

  Padding: the valid keys of row 0 are 1 and 2 (`leftpad_k` 1, `seqused_k` 3).

      iex> alias ExPhil.Native.FlashAttention, as: FA
      iex> kv = FA.Tensor.from_list([1.0, 2.0, 3.0, 4.0], {1, 4, 1, 1}, {:f, 32})
      iex> q = FA.Tensor.from_list([1.0], {1, 1, 1, 1}, {:f, 32})
      iex> [used, pad] = for n <- [3, 1], do: FA.Tensor.from_list([n], {1}, {:s, 32})
      iex> {:ok, out} = FA.forward(q, kv, kv, causal: false, seqused_k: used, leftpad_k: pad, scale: 1.0e-9)
      iex> FA.Tensor.to_list(out) |> Enum.map(&Float.round(&1, 4))
      [2.5]

  A block mask: 200 keys are two blocks of 128; `[1, 0]` hides the second.

      iex> alias ExPhil.Native.FlashAttention, as: FA
      iex> kv = FA.Tensor.from_list(List.duplicate(1.0, 128) ++ List.duplicate(100.0, 72), {1, 200, 1, 1}, {:f, 32})
      iex> q = FA.Tensor.from_list([1.0], {1, 1, 1, 1}, {:f, 32})
      iex> block_mask = FA.Tensor.from_list([1, 0], {1, 1, 1, 2}, {:u, 8})
      iex> {:ok, out} = FA.forward(q, kv, kv, causal: false, block_mask: block_mask, scale: 1.0e-9)
      iex> FA.Tensor.to_list(out) |> Enum.map(&Float.round(&1, 4))
      [1.0]

  A varlen batch: sequences of 2 and 3 rows packed in 5, each attended on its own.

      iex> alias ExPhil.Native.FlashAttention, as: FA
      iex> x = FA.Tensor.from_list([1.0, 2.0, 3.0, 4.0, 5.0], {5, 1, 1}, {:f, 32})
      iex> cu = FA.Tensor.from_list([0, 2, 5], {3}, {:s, 32})
      iex> {:ok, out, lse} = FA.varlen_forward_with_states(x, x, x, cu, cu, causal: false, scale: 1.0e-9)
      iex> {out.shape, lse.shape}
      {{5, 1, 1}, {1, 5}}
      iex> FA.Tensor.to_list(out) |> Enum.map(&Float.round(&1, 4))
      [1.5, 1.5, 4.0, 4.0, 4.0]

  ## Rotary position embeddings

  `rotary/4` and `rotary_backward/4` apply RoPE to `x` `{batch, seq, heads, head_dim}` (and its
  gradient) with float32 tables `cos`, `sin` `{max_pos, rotary_dim / 2}`; the options are
  `:interleaved`, `:positions` and `:device`, the same as Python's `flash_nif.rotary`.

  ## Decoding over (quantized) KV caches

  `quantize_kv/2`, `dequantize_kv/1`, `merge_states/2` and `decode/4` are Python's
  `flash_nif.quantize_kv`, `dequantize_kv`, `merge_states` and `decode`: the same option names,
  defaults, semantics and errors. `decode/4` runs on the CPU by default and on the GPU with
  `device: :cuda` (or `:auto` where a GPU is usable; the tensor-core kernel for f16 / bf16 at head
  dims 64, 128 and 256, the CUDA-core one otherwise; host buffers copied to GPU 0 and back). A cache is `{batch, s_cache, kv_heads, head_dim}` in
  `q`'s type, or an `ExPhil.Native.FlashAttention.QuantizedKV` (4- or 8-bit codes read as
  stored: no dequantized copy). A decode loop preallocates the cache to its longest length and
  lets `:cache_seqlens` say how much of each batch row is filled, appending each step's new keys
  and values first (`QuantizedKV.put_seq/3`, or `Tensor.put_seq/3` for a plain cache):

      alias ExPhil.Native.FlashAttention, as: FA
      alias ExPhil.Native.FlashAttention.{QuantizedKV, Tensor}

      # Room for 256 tokens in each of 2 rows, 2 kv heads of 64 dims; nothing filled yet.
      empty = Tensor.from_list(List.duplicate(0.0, 2 * 256 * 2 * 64), {2, 256, 2, 64}, {:f, 32})
      cache = %{k: FA.quantize_kv!(empty, bits: 4), v: FA.quantize_kv!(empty, bits: 4), lens: [0, 0]}

      step = fn cache, q, k_new, v_new ->
        # q {2, 1, 8, 64}; k_new, v_new {2, 1, 2, 64}: this token's query, key and value
        k = QuantizedKV.put_seq(cache.k, cache.lens, FA.quantize_kv!(k_new, bits: 4))
        v = QuantizedKV.put_seq(cache.v, cache.lens, FA.quantize_kv!(v_new, bits: 4))
        lens = Enum.map(cache.lens, &(&1 + 1))
        seqlens = Tensor.from_list(lens, {2}, {:s, 32})
        {out, _lse} = FA.decode!(q, k, v, cache_seqlens: seqlens)   # out {2, 1, 8, 64}
        {out, %{k: k, v: v, lens: lens}}
      end

  `elixir/examples/decode_loop.exs` runs this loop and checks each step against
  `forward_with_states/4` over the dequantized cache.
  """

  alias ExPhil.Native.FlashAttention.{KV, Nif, Options, Tensor}
  # Tensors in and out (Nx tensors included), and the plumbing every function shares.
  import ExPhil.Native.FlashAttention.Wire

  # Options by call: a varlen call takes no mask tensors (its packing is its padding).
  @mask_keys [:segment_ids, :seqused_k, :leftpad_k, :block_mask]
  @mod_keys [:alibi_slopes, :sinks]
  @varlen_keys [:causal, :scale, :device, :deterministic, :mode, :precision, :window, :softcap] ++ @mod_keys
  @padded_keys @varlen_keys ++ @mask_keys
  # backward/7 also takes :dlse, the gradient of the logsumexp (a tensor, wired like the masks).
  @backward_keys @padded_keys ++ [:dlse]
  @tensor_keys @mask_keys ++ [:dlse]

  @type tensor :: Tensor.t() | struct
  @type kind ::
          :argument
          | :shape
          | :dtype
          | :unsupported
          | :out_of_memory
          | :cuda_unavailable
          | :cuda
          | :nvrtc
          | :internal
          | :nif_not_loaded
  @type reason :: {kind, String.t()}
  @type side :: non_neg_integer | :infinity
  @type option ::
          {:causal, boolean}
          | {:scale, number | nil}
          | {:device, :auto | :cpu | :cuda}
          | {:deterministic, boolean}
          | {:mode, :auto | :fused | :materialized}
          | {:precision, :exact | :tf32}
          | {:window, {side, side} | nil}
          | {:segment_ids, {tensor, tensor} | nil}
          | {:seqused_k, tensor | nil}
          | {:leftpad_k, tensor | nil}
          | {:block_mask, tensor | nil}
          | {:softcap, number | nil}
          | {:alibi_slopes, tensor | nil}
          | {:sinks, tensor | nil}
          | {:dlse, tensor | nil}
  @typedoc "The options of a varlen call: those of `t:option/0` but the mask tensors."
  @type varlen_option ::
          {:causal, boolean}
          | {:scale, number | nil}
          | {:device, :auto | :cpu | :cuda}
          | {:deterministic, boolean}
          | {:mode, :auto | :fused | :materialized}
          | {:precision, :exact | :tf32}
          | {:window, {side, side} | nil}
          | {:softcap, number | nil}
          | {:alibi_slopes, tensor | nil}
          | {:sinks, tensor | nil}

  @doc """
  Attention output for `q` `{b, seq_q, heads, d}`, `k` `{b, seq_k, kv_heads, d}` and `v`
  `{b, seq_k, kv_heads, dv}`: `{:ok, output}` with output `{b, seq_q, heads, dv}` in `q`'s type.
  """
  @spec forward(tensor, tensor, tensor, [option]) :: {:ok, tensor} | {:error, reason}
  def forward(q, k, v, opts \\ []) do
    with {:ok, output, _logsumexp} <- forward_with_states(q, k, v, opts), do: {:ok, output}
  end

  @doc """
  Attention output and the row log-sum-exp the backward needs: `{:ok, output, logsumexp}`,
  output `{b, seq_q, heads, dv}` in `q`'s type and logsumexp `{b, heads, seq_q}` in `{:f, 32}`
  (natural log of each row's sum of `exp(scale * q·k)` over the keys it sees).
  """
  @spec forward_with_states(tensor, tensor, tensor, [option]) ::
          {:ok, tensor, tensor} | {:error, reason}
  def forward_with_states(q, k, v, opts \\ []) do
    with {:ok, options, masks} <- options(opts, @padded_keys),
         {:ok, options} <- wire_mods(options),
         {:ok, tensors} <- wire(q: q, k: k, v: v),
         {:ok, masks} <- wire_masks(masks),
         :ok <- loaded(),
         {:ok, o, lse} <- Nif.forward(tensors, masks, options) do
      {:ok, result(q, o, type_of(q)), result(q, lse, {:f, 32})}
    end
  end

  @doc """
  Gradients of a loss with respect to `q`, `k` and `v`, given `d_out` (its gradient with respect
  to `output`, shaped like `output`) and the `output` and `logsumexp` that `forward_with_states/4`
  returned for the same inputs and options (masks included): `{:ok, dq, dk, dv}` shaped like `q`,
  `k` and `v`, in `q`'s type; with `:sinks`, `{:ok, dq, dk, dv, dsinks}`. Error messages call
  `output` and `logsumexp` `o` and `lse`.

  `dlse: tensor` (backward only; `{:f, 32}` shaped like `logsumexp`): the loss's gradient with
  respect to `logsumexp` too, for losses that use it (merged states, z-loss). It enters each row
  as `delta - dlse`; rows that see no key ignore it.
  """
  @spec backward(tensor, tensor, tensor, tensor, tensor, tensor, [option]) ::
          {:ok, tensor, tensor, tensor} | {:ok, tensor, tensor, tensor, tensor} | {:error, reason}
  def backward(d_out, q, k, v, output, logsumexp, opts \\ []) do
    # Named as the core names them, so every message about these arguments uses one name.
    args = [d_out: d_out, q: q, k: k, v: v, o: output, lse: logsumexp]

    with {:ok, options, masks} <- options(opts, @backward_keys),
         {:ok, options} <- wire_mods(options),
         {:ok, tensors} <- wire(args),
         {:ok, masks} <- wire_masks(masks),
         :ok <- loaded() do
      tensors |> Nif.backward(masks, options) |> gradients(q)
    end
  end

  @doc """
  Attention over a packed batch of sequences of different lengths: `q` `{total_q, heads, d}`,
  `k` `{total_k, kv_heads, d}`, `v` `{total_k, kv_heads, dv}`, and `cu_seqlens_q`, `cu_seqlens_k` (`{:s, 32}`,
  `{batch + 1}`: 0, then the running totals of the lengths): sequence `b` is query rows
  `cu_seqlens_q[b]` to `cu_seqlens_q[b + 1] - 1` against key rows `cu_seqlens_k[b]` to
  `cu_seqlens_k[b + 1] - 1`, attended on its own (`:causal` and `:window` aligned bottom-right
  within it). `{:ok, output}` with output `{total_q, heads, dv}` in `q`'s type.
  """
  @spec varlen_forward(tensor, tensor, tensor, tensor, tensor, [varlen_option]) ::
          {:ok, tensor} | {:error, reason}
  def varlen_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, opts \\ []) do
    with {:ok, output, _logsumexp} <- varlen_forward_with_states(q, k, v, cu_seqlens_q, cu_seqlens_k, opts),
         do: {:ok, output}
  end

  @doc """
  `varlen_forward/6` with the row log-sum-exp the backward needs: `{:ok, output, logsumexp}`,
  logsumexp `{heads, total_q}` in `{:f, 32}`.
  """
  @spec varlen_forward_with_states(tensor, tensor, tensor, tensor, tensor, [varlen_option]) ::
          {:ok, tensor, tensor} | {:error, reason}
  def varlen_forward_with_states(q, k, v, cu_seqlens_q, cu_seqlens_k, opts \\ []) do
    with {:ok, options, _no_masks} <- options(opts, @varlen_keys),
         {:ok, options} <- wire_mods(options),
         {:ok, tensors} <- wire(q: q, k: k, v: v),
         {:ok, cu} <- wire(cu_seqlens_q: cu_seqlens_q, cu_seqlens_k: cu_seqlens_k),
         :ok <- loaded(),
         {:ok, o, lse} <- Nif.varlen_forward(tensors, cu, options) do
      {:ok, result(q, o, type_of(q)), result(q, lse, {:f, 32})}
    end
  end

  @doc """
  Gradients for a packed batch, as `backward/7` for `varlen_forward_with_states/6`: `d_out` and
  `output` `{total_q, heads, dv}`, `logsumexp` `{heads, total_q}`, and the forward's
  `cu_seqlens_q`, `cu_seqlens_k` and options: `{:ok, dq, dk, dv}` shaped like `q`, `k` and `v`
  (`{:ok, dq, dk, dv, dsinks}` with `:sinks`).
  """
  @spec varlen_backward(tensor, tensor, tensor, tensor, tensor, tensor, tensor, tensor, [varlen_option]) ::
          {:ok, tensor, tensor, tensor} | {:ok, tensor, tensor, tensor, tensor} | {:error, reason}
  def varlen_backward(d_out, q, k, v, output, logsumexp, cu_seqlens_q, cu_seqlens_k, opts \\ []) do
    args = [d_out: d_out, q: q, k: k, v: v, o: output, lse: logsumexp]

    with {:ok, options, _no_masks} <- options(opts, @varlen_keys),
         {:ok, options} <- wire_mods(options),
         {:ok, tensors} <- wire(args),
         {:ok, cu} <- wire(cu_seqlens_q: cu_seqlens_q, cu_seqlens_k: cu_seqlens_k),
         :ok <- loaded() do
      tensors |> Nif.varlen_backward(cu, options) |> gradients(q)
    end
  end

  # The NIF's gradients in q's form: dq, dk, dv in q's type, and dsinks ({:f, 32}) with sinks.
  defp gradients({:ok, dq, dk, dv}, q) do
    type = type_of(q)
    {:ok, result(q, dq, type), result(q, dk, type), result(q, dv, type)}
  end

  defp gradients({:ok, dq, dk, dv, dsinks}, q) do
    {:ok, dq, dk, dv} = gradients({:ok, dq, dk, dv}, q)
    {:ok, dq, dk, dv, result(q, dsinks, {:f, 32})}
  end

  defp gradients(error, _q), do: error

  @doc "Like `forward/4`, but returns the output and raises `ExPhil.Native.FlashAttention.Error`."
  @spec forward!(tensor, tensor, tensor, [option]) :: tensor
  def forward!(q, k, v, opts \\ []), do: q |> forward(k, v, opts) |> unwrap!()

  @doc "Like `forward_with_states/4`, but returns `{output, logsumexp}` and raises on error."
  @spec forward_with_states!(tensor, tensor, tensor, [option]) :: {tensor, tensor}
  def forward_with_states!(q, k, v, opts \\ []), do: q |> forward_with_states(k, v, opts) |> unwrap!()

  @doc "Like `backward/7`, but returns `{dq, dk, dv}` and raises on error."
  @spec backward!(tensor, tensor, tensor, tensor, tensor, tensor, [option]) ::
          {tensor, tensor, tensor} | {tensor, tensor, tensor, tensor}
  def backward!(d_out, q, k, v, output, logsumexp, opts \\ []),
    do: d_out |> backward(q, k, v, output, logsumexp, opts) |> unwrap!()

  @doc "Like `varlen_forward/6`, but returns the output and raises on error."
  @spec varlen_forward!(tensor, tensor, tensor, tensor, tensor, [varlen_option]) :: tensor
  def varlen_forward!(q, k, v, cu_seqlens_q, cu_seqlens_k, opts \\ []),
    do: q |> varlen_forward(k, v, cu_seqlens_q, cu_seqlens_k, opts) |> unwrap!()

  @doc "Like `varlen_forward_with_states/6`, but returns `{output, logsumexp}` and raises on error."
  @spec varlen_forward_with_states!(tensor, tensor, tensor, tensor, tensor, [varlen_option]) ::
          {tensor, tensor}
  def varlen_forward_with_states!(q, k, v, cu_seqlens_q, cu_seqlens_k, opts \\ []),
    do: q |> varlen_forward_with_states(k, v, cu_seqlens_q, cu_seqlens_k, opts) |> unwrap!()

  @doc "Like `varlen_backward/9`, but returns `{dq, dk, dv}` and raises on error."
  @spec varlen_backward!(tensor, tensor, tensor, tensor, tensor, tensor, tensor, tensor, [varlen_option]) ::
          {tensor, tensor, tensor} | {tensor, tensor, tensor, tensor}
  def varlen_backward!(d_out, q, k, v, output, logsumexp, cu_seqlens_q, cu_seqlens_k, opts \\ []),
    do: d_out |> varlen_backward(q, k, v, output, logsumexp, cu_seqlens_q, cu_seqlens_k, opts) |> unwrap!()

  @doc """
  What the native library offers: `{:ok, %{version: String.t, backends: [:cpu | :cuda],
  last_kernels: %{forward: k, backward: k}}}`, where `k` is `%{kernel: name | nil,
  not_sm90_because: reason | nil, math: math | nil}`: the GPU kernel this VM last ran for that
  pass, when it was not the Hopper kernel, why (`FLASH_NIF_SM90=0`, a mask, a head dim, ...), and
  how its products were computed (`"3xf16"`, `"3xtf32"`, `"1xf16"`, `"tf32"`, `"f32-simt"`, `"f16"`, `"bf16"`; see
  `:precision`). `FLASH_NIF_LOG=1` prints the same per call on stderr.
  """
  @spec info() :: {:ok, %{version: String.t(), backends: [atom], last_kernels: map}} | {:error, reason}
  def info do
    with :ok <- loaded(), {:ok, version, backends, kernels} <- Nif.info() do
      last =
        Map.new(kernels, fn {pass, kernel, why, math} ->
          {String.to_atom(pass), %{kernel: kernel, not_sm90_because: why, math: math}}
        end)

      {:ok, %{version: version, backends: Enum.map(backends, &String.to_atom/1), last_kernels: last}}
    end
  end

  @doc """
  Whether the GPU backend can run here: the library has its CUDA backend, the driver sees a GPU
  and NVRTC is found, i.e. `info/0` lists `:cuda` (and `device: :auto` will use it). `false` when
  the NIF is not loaded.
  """
  @spec cuda_available?() :: boolean
  def cuda_available? do
    case info() do
      {:ok, %{backends: backends}} -> :cuda in backends
      {:error, _} -> false
    end
  end

  @doc """
  A one-line summary of the backends for logs, built from `info/0`: the backend `device: :auto`
  picks first, then the library version and the backends, e.g.
  `"cpu (flash_nif 0.1.0; backends: cpu; no usable CUDA GPU)"` or
  `"cuda (flash_nif 0.1.0; backends: cpu, cuda)"`; `"unavailable (...)"` with the reason when the
  NIF is not loaded.
  """
  @spec backend_info() :: String.t()
  def backend_info do
    case info() do
      {:ok, %{version: version, backends: backends}} ->
        list = Enum.map_join(backends, ", ", &Atom.to_string/1)

        if :cuda in backends,
          do: "cuda (flash_nif #{version}; backends: #{list})",
          else: "cpu (flash_nif #{version}; backends: #{list}; no usable CUDA GPU)"

      {:error, {_kind, message}} ->
        "unavailable (#{message})"
    end
  end

  ## Options

  # The NIF's options map: every key, defaults filled (the one place they are set).
  @defaults %{
    causal: true,
    scale: nil,
    device: :cpu,
    deterministic: false,
    mode: :auto,
    precision: :exact,
    window: {nil, nil},
    softcap: nil,
    alibi_slopes: nil,
    sinks: nil
  }
  @max_i64 Options.max_i64()

  # {:ok, options_map, masks}: the NIF's options, and the mask options given (a keyword list of
  # the caller's tensors). Types are checked here, values (scale > 0, mask shapes) in the core.
  defp options(opts, keys) when is_list(opts) do
    Enum.reduce_while(opts, {:ok, @defaults, []}, fn
      {key, value}, {:ok, options, masks} when is_atom(key) ->
        cond do
          key not in keys and key in @mask_keys ->
            {:halt,
             unsupported(
               "the #{inspect(key)} option does not apply to a varlen call (each packed sequence " <>
                 "is attended on its own); the options are #{inspect(keys)}"
             )}

          key not in keys ->
            {:halt, unsupported("unknown option #{inspect(key)}; the options are #{inspect(keys)}")}

          key in @tensor_keys ->
            case mask(key, value) do
              :ok when value == nil -> {:cont, {:ok, options, Keyword.delete(masks, key)}}
              :ok -> {:cont, {:ok, options, Keyword.put(masks, key, value)}}
              error -> {:halt, error}
            end

          true ->
            case option(key, value) do
              {:ok, v} -> {:cont, {:ok, Map.put(options, key, v), masks}}
              error -> {:halt, error}
            end
        end

      other, _ ->
        {:halt, unsupported("options must be a keyword list, got the element #{inspect(other)}")}
    end)
  end

  defp options(opts, _keys), do: unsupported("options must be a keyword list, got: #{inspect(opts)}")

  # Modifier tensors: wired by wire_mods/1 (nil: not given); the rest as Options checks them.
  defp option(key, t) when key in @mod_keys, do: {:ok, t}
  defp option(key, value), do: Options.option(key, value)

  # Mask values are tensors, checked when wired; nil means not given.
  defp mask(_key, nil), do: :ok
  defp mask(:segment_ids, {_seg_q, _seg_k}), do: :ok

  defp mask(:segment_ids, other),
    do: unsupported("the :segment_ids option must be a tuple {seg_q, seg_k} of tensors, got: #{short(other)}")

  defp mask(_key, _tensor), do: :ok

  ## Tensors in and out

  # The options map with its modifier tensors (alibi_slopes, sinks) wired; nil stays nil.
  defp wire_mods(options) do
    Enum.reduce_while(@mod_keys, {:ok, options}, fn key, {:ok, acc} ->
      case acc[key] do
        nil ->
          {:cont, {:ok, acc}}

        t ->
          case wire(t, key) do
            {:ok, w} -> {:cont, {:ok, Map.put(acc, key, w)}}
            error -> {:halt, error}
          end
      end
    end)
  end

  # The NIF's masks map from the mask options: segment ids travel as {seg_q, seg_k}, named
  # seg_q and seg_k in messages.
  defp wire_masks(masks) do
    named =
      Enum.flat_map(masks, fn
        {:segment_ids, {seg_q, seg_k}} -> [seg_q: seg_q, seg_k: seg_k]
        other -> [other]
      end)

    with {:ok, wired} <- wire(named) do
      {segments, rest} =
        named |> Keyword.keys() |> Enum.zip(wired) |> Map.new() |> Map.split([:seg_q, :seg_k])

      case segments do
        %{seg_q: q, seg_k: k} -> {:ok, Map.put(rest, :segment_ids, {q, k})}
        _ -> {:ok, rest}
      end
    end
  end

  ## Rotary position embeddings

  @rotary_keys [:interleaved, :positions, :device]

  @typedoc "The options of `rotary/4` and `rotary_backward/4`."
  @type rotary_option ::
          {:interleaved, boolean}
          | {:positions, non_neg_integer | tensor | nil}
          | {:device, :auto | :cpu | :cuda}

  @doc """
  Rotary position embeddings (RoPE) of `x` `{b, seq, heads, d}`: `{:ok, y}`, y like `x` (shape
  and type). `cos` and `sin` are `{:f, 32}` `{max_pos, r / 2}`: they rotate the first
  `r = 2 * elem(cos.shape, 1) <= d` dims of every head, the rest pass through unchanged.

  Row `{b, s}` takes table row `p = positions[b][s]`, or `s + offset`. Angle `i` turns the pair
  `(i, i + r / 2)` (GPT-NeoX, the default) or `(2i, 2i + 1)` (`interleaved: true`, GPT-J):
  `y[a] = x[a] * cos[p][i] - x[b] * sin[p][i]`, `y[b] = x[b] * cos[p][i] + x[a] * sin[p][i]`.
  Arithmetic is f32; `y` is stored in `x`'s type.

  Options:

    * `:interleaved` — pairs `(2i, 2i + 1)` instead of `(i, i + r / 2)` (default `false`).
    * `:positions` — `nil` (default: row `s` takes table row `s`), a non-negative integer offset
      (row `s` takes `s + offset`: a decode step after a cache of that length), or a `{:s, 32}`
      tensor `{b, seq}` of table rows (packed documents, ragged caches). Every position must lie
      in `[0, max_pos)`: anything else is a `:shape` error, never a read past the tables.
    * `:device` — as for `forward/4` (`:cpu` by default).

  Errors as for `forward/4`: `:shape` (ranks, `r > d`, `cos` and `sin` of different shapes,
  positions out of range), `:dtype` (`x` not a float type, tables not `{:f, 32}`, positions not
  `{:s, 32}`), `:unsupported` (a bad option, a negative offset).

      iex> alias ExPhil.Native.FlashAttention, as: FA
      iex> x = FA.Tensor.from_list([1.0, 0.0, 5.0], {1, 1, 1, 3}, {:f, 32})
      iex> cos = FA.Tensor.from_list([1.0, 0.0], {2, 1}, {:f, 32})
      iex> sin = FA.Tensor.from_list([0.0, 1.0], {2, 1}, {:f, 32})
      iex> {:ok, y} = FA.rotary(x, cos, sin, positions: 1)
      iex> FA.Tensor.to_list(y)
      [0.0, 1.0, 5.0]
  """
  @spec rotary(tensor, tensor, tensor, [rotary_option]) :: {:ok, tensor} | {:error, reason}
  def rotary(x, cos, sin, opts \\ []), do: rotary_call(:rotary, [x: x, cos: cos, sin: sin], opts)

  @doc """
  The gradient of `rotary/4`'s `x` given `dy`, the gradient of its output: `{:ok, dx}`, `dx` like
  `dy`. Pass the forward's `cos`, `sin` and options. It is the transpose rotation (by −θ), so it
  also undoes `rotary/4`: `rotary_backward(rotary(x))` is `x` up to rounding.
  """
  @spec rotary_backward(tensor, tensor, tensor, [rotary_option]) :: {:ok, tensor} | {:error, reason}
  def rotary_backward(dy, cos, sin, opts \\ []),
    do: rotary_call(:rotary_backward, [dy: dy, cos: cos, sin: sin], opts)

  @doc "Like `rotary/4`, but returns `y` and raises `ExPhil.Native.FlashAttention.Error`."
  @spec rotary!(tensor, tensor, tensor, [rotary_option]) :: tensor
  def rotary!(x, cos, sin, opts \\ []), do: x |> rotary(cos, sin, opts) |> unwrap!()

  @doc "Like `rotary_backward/4`, but returns `dx` and raises on error."
  @spec rotary_backward!(tensor, tensor, tensor, [rotary_option]) :: tensor
  def rotary_backward!(dy, cos, sin, opts \\ []), do: dy |> rotary_backward(cos, sin, opts) |> unwrap!()

  defp rotary_call(fun, [{_name, x} | _] = named, opts) do
    with {:ok, options, positions} <- rotary_options(opts),
         {:ok, tensors} <- wire(named),
         {:ok, positions} <- wire_positions(positions),
         :ok <- loaded(),
         {:ok, y} <- rotary_nif(fun, tensors, positions, options) do
      {:ok, result(x, y, type_of(x))}
    end
  end

  defp rotary_nif(:rotary, tensors, positions, options), do: Nif.rotary(tensors, positions, options)

  defp rotary_nif(:rotary_backward, tensors, positions, options),
    do: Nif.rotary_backward(tensors, positions, options)

  # {:ok, %{interleaved: _, device: _}, positions}: types checked here, values in the core.
  defp rotary_options(opts) when is_list(opts) do
    Enum.reduce_while(opts, {:ok, %{interleaved: false, device: :cpu}, nil}, fn
      {:interleaved, i}, {:ok, o, p} when is_boolean(i) ->
        {:cont, {:ok, %{o | interleaved: i}, p}}

      {:interleaved, i}, _ ->
        {:halt, unsupported("the :interleaved option must be true or false, got: #{inspect(i)}")}

      {:device, d}, {:ok, o, p} ->
        case option(:device, d) do
          {:ok, d} -> {:cont, {:ok, %{o | device: d}, p}}
          error -> {:halt, error}
        end

      {:positions, p}, {:ok, o, _} when is_nil(p) or (is_integer(p) and abs(p) <= @max_i64) or is_struct(p) ->
        {:cont, {:ok, o, p}}

      {:positions, p}, _ ->
        {:halt,
         unsupported(
           "the :positions option must be nil, a non-negative integer offset or a {:s, 32} tensor " <>
             "{batch, seq}, got: #{short(p)}"
         )}

      {key, _}, _ when is_atom(key) ->
        {:halt, unsupported("unknown option #{inspect(key)}; the options are #{inspect(@rotary_keys)}")}

      other, _ ->
        {:halt, unsupported("options must be a keyword list, got the element #{inspect(other)}")}
    end)
  end

  defp rotary_options(opts), do: unsupported("options must be a keyword list, got: #{inspect(opts)}")

  defp wire_positions(p) when is_nil(p) or is_integer(p), do: {:ok, p}
  defp wire_positions(t), do: wire(t, :positions)

  ## KV caches and decode (ExPhil.Native.FlashAttention.KV)

  @typedoc "The options of `quantize_kv/2`."
  @type quant_option :: {:bits, 4 | 8} | {:group_size, 32 | 64}

  @typedoc "The options of `decode/4`: Python's `flash_nif.decode` keywords."
  @type decode_option ::
          {:cache_seqlens, tensor | nil}
          | {:leftpad_k, tensor | nil}
          | {:causal, boolean}
          | {:scale, number | nil}
          | {:window, {side, side} | nil}
          | {:softcap, number | nil}
          | {:num_splits, pos_integer | nil}
          | {:device, :cpu}

  @doc """
  `x` `{b, s, kv_heads, d}` (`{:f, 32}`, `{:f, 16}` or `{:bf, 16}`) quantized:
  `{:ok, %ExPhil.Native.FlashAttention.QuantizedKV{}}` (its moduledoc has the format), bit for
  bit what Python's `flash_nif.quantize_kv` and the float64 oracle give. Its parts take the form
  of `x` (Nx tensors when `x` is one).

  Options: `:bits` — 4 (default) or 8; `:group_size` — 64 (default) or 32, elements of the head
  dim per scale and bias; it must divide `d`.

  Errors: `:unsupported` (other bits or group sizes, an unknown option), `:shape` (`x` not of
  rank 4, `d` not a multiple of the group size or past 256), `:dtype` (`x` not a float type).

      iex> alias ExPhil.Native.FlashAttention, as: FA
      iex> x = FA.Tensor.from_list(Enum.map(0..31, &(rem(&1, 16) * 1.0)), {1, 1, 1, 32}, {:f, 32})
      iex> {:ok, c} = FA.quantize_kv(x, bits: 4, group_size: 32)
      iex> {c.shape, c.values.shape, c.scales.shape, FA.Tensor.to_list(c.scales)}
      {{1, 1, 1, 32}, {1, 1, 1, 4}, {1, 1, 1, 1}, [1.0]}
      iex> FA.dequantize_kv!(c) == x
      true
  """
  @spec quantize_kv(tensor, [quant_option]) ::
          {:ok, ExPhil.Native.FlashAttention.QuantizedKV.t()} | {:error, reason}
  def quantize_kv(x, opts \\ []), do: KV.quantize_kv(x, opts)

  @doc """
  A quantized cache back in its float type: `{:ok, x}`, `x` `{b, s, kv_heads, d}` in the scales'
  type, `scale * q + bias` computed in f32 (within half a quantization step of the original).
  Errors: `:argument` (not a `QuantizedKV`), `:shape` (scales or biases not `{b, s, kv_heads,
  d / group_size}`), `:dtype` (`values` not `{:u, 32}`, scales and biases of two types),
  `:unsupported` (bits or group size).
  """
  @spec dequantize_kv(ExPhil.Native.FlashAttention.QuantizedKV.t()) :: {:ok, tensor} | {:error, reason}
  def dequantize_kv(cache), do: KV.dequantize_kv(cache)

  @doc """
  Attention over the union of disjoint key sets from each set's output and logsumexp:
  `o_parts` `{p, b, seq_q, heads, dv}` (a float type) and `lse_parts` `{p, b, heads, seq_q}`
  (`{:f, 32}`), each stacked or as a list of `p` tensors. `{:ok, o, lse}` with `lse =
  log(Σ exp(lse_p))` and `o = Σ exp(lse_p - lse) o_p` in `o_parts`' type; parts with logsumexp
  `:neg_infinity` weigh nothing, and a row no part saw gives `o = 0`, `lse = :neg_infinity`.
  Errors: `:shape` (`lse_parts` not `{p, b, heads, seq_q}`, list parts of different shapes),
  `:dtype` (`lse_parts` not `{:f, 32}`).

      iex> alias ExPhil.Native.FlashAttention, as: FA
      iex> o = [FA.Tensor.from_list([1.0, 2.0], {1, 1, 1, 2}, {:f, 32}), FA.Tensor.from_list([3.0, 4.0], {1, 1, 1, 2}, {:f, 32})]
      iex> lse = [FA.Tensor.from_list([0.0], {1, 1, 1}, {:f, 32}), FA.Tensor.from_list([0.0], {1, 1, 1}, {:f, 32})]
      iex> {:ok, out, lse} = FA.merge_states(o, lse)
      iex> {FA.Tensor.to_list(out), Enum.map(FA.Tensor.to_list(lse), &Float.round(&1, 6))}
      {[2.0, 3.0], [0.693147]}
  """
  @spec merge_states(tensor | [tensor], tensor | [tensor]) :: {:ok, tensor, tensor} | {:error, reason}
  def merge_states(o_parts, lse_parts), do: KV.merge_states(o_parts, lse_parts)

  @doc """
  Attention of a few new queries `q` `{b, seq_q, heads, d}` (`seq_q` 1 to 16) over a KV cache:
  `k_cache`, `v_cache` `{b, s_cache, kv_heads, d}` in `q`'s type, or
  `ExPhil.Native.FlashAttention.QuantizedKV`s with scales in `q`'s type (read as stored, no
  dequantized copy). `{:ok, output, logsumexp}`, output `{b, seq_q, heads, d}` in `q`'s type,
  logsumexp `{b, heads, seq_q}` `{:f, 32}`, as `forward_with_states/4`. `heads` must be a
  multiple of `kv_heads`; each key is read once for its whole GQA group.

  Options (Python's `flash_nif.decode` keywords, same defaults):

    * `:cache_seqlens`, `:leftpad_k` — `{:s, 32}` `{b}`: row `r`'s valid keys are
      `leftpad_k[r] <= j < cache_seqlens[r]` (defaults 0 and `s_cache`; `0 <= leftpad_k[r] <=
      cache_seqlens[r] <= s_cache`). A row with none gives output 0, logsumexp `:neg_infinity`.
    * `:causal` (default `true`) and `:window` (`{left, right}`, as for `forward/4`) — aligned to
      the end of the valid keys: the last query sees every one of them.
    * `:scale` (default `1 / sqrt(d)`), `:softcap` — as for `forward/4`.
    * `:num_splits` — split each row's keys this many ways and merge the parts by their
      logsumexp (`nil`, the default: chosen from the sizes). Results agree to rounding.
    * `:device` — `:cpu` (the default and, for now, the only one: `:cuda` and `:auto` are
      `:unsupported` errors, never a silent CPU run).

  Errors: `:shape` (ranks, batch or head dims that disagree, `seq_q` outside 1..16, lengths
  outside `[0, s_cache]`, length tensors not `{b}`), `:dtype` (caches not in `q`'s type, lengths
  not `{:s, 32}`), `:unsupported` (an option's type or value), `:argument` (not a tensor).

      iex> alias ExPhil.Native.FlashAttention, as: FA
      iex> q = FA.Tensor.from_list([1.0, 0.0], {1, 1, 1, 2}, {:f, 32})
      iex> kv = FA.Tensor.from_list([1.0, 2.0, 3.0, 4.0, 5.0, 6.0], {1, 3, 1, 2}, {:f, 32})
      iex> lens = FA.Tensor.from_list([2], {1}, {:s, 32})
      iex> {:ok, out, _lse} = FA.decode(q, kv, kv, cache_seqlens: lens, scale: 1.0e-9)
      iex> FA.Tensor.to_list(out) |> Enum.map(&Float.round(&1, 4))
      [2.0, 3.0]
  """
  @spec decode(
          tensor,
          tensor | ExPhil.Native.FlashAttention.QuantizedKV.t(),
          tensor | ExPhil.Native.FlashAttention.QuantizedKV.t(),
          [decode_option]
        ) ::
          {:ok, tensor, tensor} | {:error, reason}
  def decode(q, k_cache, v_cache, opts \\ []), do: KV.decode(q, k_cache, v_cache, opts)

  @doc "Like `quantize_kv/2`, but returns the `QuantizedKV` and raises on error."
  @spec quantize_kv!(tensor, [quant_option]) :: ExPhil.Native.FlashAttention.QuantizedKV.t()
  def quantize_kv!(x, opts \\ []), do: x |> quantize_kv(opts) |> unwrap!()

  @doc "Like `dequantize_kv/1`, but returns the tensor and raises on error."
  @spec dequantize_kv!(ExPhil.Native.FlashAttention.QuantizedKV.t()) :: tensor
  def dequantize_kv!(cache), do: cache |> dequantize_kv() |> unwrap!()

  @doc "Like `merge_states/2`, but returns `{o, lse}` and raises on error."
  @spec merge_states!(tensor | [tensor], tensor | [tensor]) :: {tensor, tensor}
  def merge_states!(o_parts, lse_parts), do: o_parts |> merge_states(lse_parts) |> unwrap!()

  @doc "Like `decode/4`, but returns `{output, logsumexp}` and raises on error."
  @spec decode!(
          tensor,
          tensor | ExPhil.Native.FlashAttention.QuantizedKV.t(),
          tensor | ExPhil.Native.FlashAttention.QuantizedKV.t(),
          [decode_option]
        ) :: {tensor, tensor}
  def decode!(q, k_cache, v_cache, opts \\ []), do: q |> decode(k_cache, v_cache, opts) |> unwrap!()
end
