defmodule FlashNif.Fixtures do
  @moduledoc false
  # Reads tests/fixtures/attention/ (written by tests/fixtures/generate.py from the float64
  # oracle): every case with its tensors as ExPhil.Native.FlashAttention.Tensor structs.

  alias ExPhil.Native.FlashAttention, as: FA
  alias ExPhil.Native.FlashAttention.Tensor

  @dir Path.expand("../../../tests/fixtures/attention", __DIR__)

  def dir, do: @dir

  @doc """
  All cases: maps with :name, :dtype, :causal, :scale, :window, :masks, :softcap, :modifiers,
  :varlen, :tol (a map), :tensors (a map) and :opts, the options to call it with (masks and
  score modifiers included).
  """
  def cases, do: for(c <- manifest(@dir), do: load(c))

  defp load(c) do
    tensors = tensors(@dir, c)
    %{c | tensors: tensors} |> Map.put(:opts, opts(c, tensors))
  end

  @doc """
  The cases of a fixture folder's manifest.eterm (tests/fixtures/<folder>, written by the
  generators there), tensors as their descriptions.
  """
  def manifest(dir) do
    {:ok, terms} = :file.consult(String.to_charlist(Path.join(dir, "manifest.eterm")))
    {:header, %{byte_order: "little"}} = hd(terms)
    for {:fixture, c} <- terms, do: c
  end

  @doc "Case `c`'s tensors from its file in `dir`: Tensor structs by atom name, in native byte order."
  def tensors(dir, c) do
    blob = File.read!(Path.join(dir, c.file))

    Map.new(c.tensors, fn t ->
      type = type(t.dtype)
      data = blob |> binary_part(t.offset, t.nbytes) |> little_to_native(Tensor.byte_size(type))
      {String.to_atom(t.name), %Tensor{data: data, shape: List.to_tuple(t.shape), type: type}}
    end)
  end

  # The manifest's window ([left, right], nil for an unbounded side), mask names, softcap (a number
  # or nil: nil is the same as leaving it out) and modifier tensor names as options.
  defp opts(c, t) do
    window = if c.window, do: [window: c.window |> Enum.map(&(&1 || :infinity)) |> List.to_tuple()], else: []

    masks =
      for key <- c.masks do
        case String.to_atom(key) do
          :segment_ids -> {:segment_ids, {t.seg_q, t.seg_k}}
          key -> {key, Map.fetch!(t, key)}
        end
      end

    mods = for key <- c.modifiers, key = String.to_atom(key), do: {key, Map.fetch!(t, key)}

    [causal: c.causal, scale: c.scale, softcap: c.softcap] ++ window ++ masks ++ mods
  end

  def type("float32"), do: {:f, 32}
  def type("float16"), do: {:f, 16}
  def type("bfloat16"), do: {:bf, 16}
  def type("int32"), do: {:s, 32}
  def type("uint8"), do: {:u, 8}
  def type("uint32"), do: {:u, 32}

  @doc "A case's forward on its inputs with `opts` (padded or varlen): `{:ok, o, lse}` or the error."
  def forward(%{varlen: true, tensors: t}, opts),
    do: FA.varlen_forward_with_states(t.q, t.k, t.v, t.cu_seqlens_q, t.cu_seqlens_k, opts)

  def forward(%{tensors: t}, opts), do: FA.forward_with_states(t.q, t.k, t.v, opts)

  @doc """
  A case's backward from the states `o`, `lse`: `{:ok, dq, dk, dv}`, `{:ok, dq, dk, dv, dsinks}`
  with sinks, or the error.
  """
  def backward(%{varlen: true, tensors: t}, o, lse, opts),
    do: FA.varlen_backward(t.d_out, t.q, t.k, t.v, o, lse, t.cu_seqlens_q, t.cu_seqlens_k, opts)

  def backward(%{tensors: t}, o, lse, opts), do: FA.backward(t.d_out, t.q, t.k, t.v, o, lse, opts)

  @doc "A backward's result as `{:ok, [dq: _, dk: _, dv: _]}`, with `dsinks: _` last when it has one."
  def gradients({:ok, dq, dk, dv}), do: {:ok, [dq: dq, dk: dk, dv: dv]}
  def gradients({:ok, dq, dk, dv, dsinks}), do: {:ok, [dq: dq, dk: dk, dv: dv, dsinks: dsinks]}
  def gradients(error), do: error

  defp little_to_native(bin, size) do
    case :erlang.system_info(:endian) do
      :little -> bin
      :big -> for <<x::little-size(size * 8) <- bin>>, into: <<>>, do: <<x::big-size(size * 8)>>
    end
  end

  @doc """
  Relative errors of a case's results against its fixture: forward (o, lse), the backward from the
  fixture's own o and lse (dq, dk, dv, and dsinks with sinks) and the backward from our o and lse
  (dq_own, dk_own, dv_own, dsinks_own); `grads` and `grads_own` as `gradients/1` gives them.
  """
  def errors(t, {o, lse}, grads, grads_own) do
    alias FlashNif.Numeric

    own = for {name, g} <- grads_own, do: {:"#{name}_own", Numeric.rel_err(g, Map.fetch!(t, name))}

    [o: Numeric.rel_err(o, t.o), lse: Numeric.rel_err(lse, t.lse)] ++
      for({name, g} <- grads, do: {name, Numeric.rel_err(g, Map.fetch!(t, name))}) ++ own
  end
end

defmodule FlashNif.Numeric do
  @moduledoc false
  # Error measures shared by the tests (the convention of tests/conftest.py).

  alias ExPhil.Native.FlashAttention.Tensor

  @doc """
  ||got - want|| / ||want|| over the finite entries of `want`; non-finite entries must sit at the
  same places with the same values, else the error is :infinity.
  """
  def rel_err(%Tensor{} = got, %Tensor{} = want) do
    unless got.shape == want.shape, do: raise("shape #{inspect(got.shape)} != #{inspect(want.shape)}")
    rel_err(Tensor.to_list(got), Tensor.to_list(want))
  end

  def rel_err(got, want) when is_list(got) and is_list(want) do
    pairs = Enum.zip(got, want)

    if Enum.all?(pairs, fn {g, w} -> is_float(w) == is_float(g) and (is_float(w) or g == w) end) do
      {num, den} =
        Enum.reduce(pairs, {0.0, 0.0}, fn
          {g, w}, {n, d} when is_float(w) -> {n + (g - w) * (g - w), d + w * w}
          _, acc -> acc
        end)

      if den == 0.0, do: :math.sqrt(num), else: :math.sqrt(num / den)
    else
      :infinity
    end
  end

  @doc "A tensor of `type` with standard-normal entries from a seeded generator."
  def random(shape, type, seed) do
    state = :rand.seed_s(:exsss, {seed, 17, 29})

    n = Tensor.size(shape)
    {values, _} = Enum.map_reduce(List.duplicate(nil, n), state, fn _, s -> :rand.normal_s(s) end)
    Tensor.from_list(values, shape, type)
  end
end
