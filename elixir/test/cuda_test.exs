defmodule FlashNif.CudaTest do
  # The GPU backend through the NIF: `device: :cuda` and `device: :auto` run the same CUDA kernels
  # as the Python module (flash-core's cuda::forward_host / backward_host, host buffers copied to
  # and from the GPU). Tagged :cuda; test_helper.exs leaves these out on machines without a usable
  # GPU (FLASH_NIF_TEST_CUDA=1 requires them). scripts/gpu_test.sh runs them on the GPU machine.
  #
  # Accuracy, on random inputs drawn in the storage type (odd sizes, GQA/MQA, causal with
  # Sq < Sk and Sq > Sk, so some rows see no key):
  #   * the reference is the CPU backend in float32 on the same values (the CPU backend is itself
  #     checked against the float64 oracle by oracle_fixtures_test.exs to ~3e-7); the backward
  #     reference is given the GPU's own o and lse, as a training loop would;
  #   * tolerances are the project's (tests/conftest.py): float32 1e-5; float16/bfloat16 twice the
  #     error of the reference itself rounded to the type, + 1e-5; lse (always f32) 1e-5;
  #   * the oracle fixtures (tests/fixtures/attention, float64) are also run on the GPU;
  #   * the forward is deterministic (a second call returns the same bits); the backward's second
  #     call must meet the same tolerances, and whether its bits repeat is printed (the GPU
  #     backward may sum dQ with atomics, so it is not asserted).
  # Every case prints its errors (GPU and, for comparison, the CPU in the same storage type).
  use ExUnit.Case, async: false

  alias ExPhil.Native.FlashAttention, as: FA
  alias ExPhil.Native.FlashAttention.Tensor
  alias FlashNif.{Fixtures, Numeric}

  @moduletag :cuda
  @moduletag timeout: 600_000

  @types [{:f, 32}, {:f, 16}, {:bf, 16}]
  @labels %{{:f, 32} => "f32", {:f, 16} => "f16", {:bf, 16} => "bf16"}
  @outputs [:o, :lse, :dq, :dk, :dv]

  # {batch, seq_q, seq_k, heads, kv_heads, head_dim}
  @shapes [
    {2, 97, 130, 4, 2, 64},
    {1, 130, 97, 4, 1, 72}
  ]

  # name, type, shape, extra options
  @cases (for shape <- @shapes, type <- @types, causal <- [true, false] do
            {b, sq, sk, h, hkv, d} = shape

            name =
              "#{@labels[type]} b#{b} sq#{sq} sk#{sk} h#{h}/#{hkv} d#{d} #{if causal, do: "causal", else: "full"}"

            {name, type, shape, [causal: causal]}
          end) ++
           [
             {"f16 d8 causal", {:f, 16}, {1, 33, 45, 2, 1, 8}, [causal: true]},
             {"bf16 d40 full scale 0.3", {:bf, 16}, {2, 45, 33, 4, 2, 40}, [causal: false, scale: 0.3]},
             {"f32 d128 causal", {:f, 32}, {1, 65, 65, 2, 2, 128}, [causal: true]},
             {"bf16 d256 causal", {:bf, 16}, {1, 70, 90, 2, 1, 256}, [causal: true]}
           ]

  defp label(type), do: @labels[type]

  setup_all do
    probe = Numeric.random({1, 4, 1, 8}, {:f, 32}, 1)

    case FA.forward(probe, probe, probe, device: :cuda) do
      {:ok, _} -> :ok
      {:error, reason} -> raise "the :cuda tests need a usable GPU; device: :cuda says #{inspect(reason)}"
    end

    results = Map.new(@cases, fn {name, type, shape, opts} -> {name, run_case(type, shape, opts)} end)
    fixtures = Map.new(Fixtures.cases(), &{&1.name, run_fixture(&1)})
    report(results, fixtures)
    {:ok, results: results, fixtures: fixtures}
  end

  for {name, _, _, _} <- @cases do
    test "#{name}: forward and backward on :cuda match the reference", %{results: results} do
      assert {:ok, r} = results[unquote(name)]

      for out <- @outputs do
        %{cuda: err, tol: tol} = r.errors[out]
        assert err <= tol, "#{unquote(name)} #{out}: relative error #{inspect(err)} > tolerance #{tol}"
      end

      assert r.forward_repeats, "#{unquote(name)}: a second :cuda forward gave different bits"

      for {out, err} <- r.second_backward do
        assert err <= r.errors[out].tol,
               "#{unquote(name)} #{out} (second backward): relative error #{inspect(err)} > tolerance"
      end
    end
  end

  test "the float64 oracle fixtures on :cuda (every head dim: 12 runs through the padding layer)",
       %{fixtures: fixtures} do
    assert Enum.any?(Fixtures.cases(), &(rem(&1.head_dim, 8) != 0))

    for c <- Fixtures.cases() do
      assert {:ok, errs} = fixtures[c.name], "#{c.name}: #{inspect(fixtures[c.name])}"
      assert Keyword.has_key?(errs, :dsinks) == Map.has_key?(c.tensors, :dsinks), c.name

      for {out, err} <- errs do
        # dsinks_own has its own tolerance; dq_own etc. take dq's
        tol =
          Map.get_lazy(c.tol, out, fn ->
            c.tol[out |> Atom.to_string() |> String.trim_trailing("_own") |> String.to_atom()]
          end)

        assert err <= tol, "#{c.name} #{out} on :cuda: relative error #{inspect(err)} > tolerance #{tol}"
      end
    end
  end

  test "device: :auto runs on the GPU: the forward's bits are :cuda's, not the CPU's" do
    {q, k, v, d_out} = inputs({:f, 32}, {2, 97, 130, 4, 2, 64}, 100)

    {:ok, o, lse} = FA.forward_with_states(q, k, v, device: :cuda)
    assert {:ok, ^o, ^lse} = FA.forward_with_states(q, k, v, device: :auto)
    # Without this the check above could not tell the GPU from the CPU.
    {:ok, cpu_o, _} = FA.forward_with_states(q, k, v, device: :cpu)
    assert cpu_o.data != o.data, "the CPU and the GPU gave identical bits"

    {:ok, dq, dk, dv} = FA.backward(d_out, q, k, v, o, lse, device: :cuda)
    {:ok, adq, adk, adv} = FA.backward(d_out, q, k, v, o, lse, device: :auto)
    for {a, g} <- [{adq, dq}, {adk, dk}, {adv, dv}], do: assert(Numeric.rel_err(a, g) <= 1.0e-6)
    assert {:ok, %{backends: backends, last_kernels: last}} = FA.info()
    assert :cuda in backends
    # f32 "exact" at D = 64: the Hopper kernel (split products on wgmma, fp16 parts) on compute
    # capability 9.0, else the portable one, and why.
    if last.forward.kernel =~ ~r/^fwd_sm90_f32_d64_/ do
      assert last.forward.not_sm90_because == nil
      assert last.forward.math == "3xf16"
    else
      assert last.forward.kernel =~ ~r/^fwd_f32_d64/
      assert last.forward.not_sm90_because =~ ~r/9\.0|FLASH_NIF_SM90/
    end
    # Its backward likewise: the Hopper f32 dQ and dK/dV kernels (info names the dK/dV one).
    if last.backward.kernel =~ ~r/^bwd_sm90_f32_d64_/ do
      assert last.backward.not_sm90_because == nil
      assert last.backward.math == "3xf16"
    else
      assert last.backward.math == "f32-simt"
      assert last.backward.not_sm90_because =~ ~r/9\.0|FLASH_NIF_SM90/
    end
  end

  test "deterministic: true repeats the GPU backward bit for bit; the default is within rounding" do
    for type <- [{:bf, 16}, {:f, 32}] do
      {q, k, v, d_out} = inputs(type, {2, 200, 200, 8, 2, 128}, 7)
      {:ok, o, lse} = FA.forward_with_states(q, k, v, device: :cuda)
      det = fn -> FA.backward(d_out, q, k, v, o, lse, device: :cuda, deterministic: true) end
      {:ok, dq, dk, dv} = det.()
      for _ <- 1..2, do: assert({:ok, ^dq, ^dk, ^dv} = det.())
      {:ok, adq, adk, adv} = FA.backward(d_out, q, k, v, o, lse, device: :cuda)
      # The default path (other tiles, dq summed by atomics) agrees to within rounding.
      for {a, g} <- [{adq, dq}, {adk, dk}, {adv, dv}], do: assert(Numeric.rel_err(a, g) <= 1.0e-2)
    end
  end

  test "head_dim 12 (not a multiple of 8) runs on :cuda through the padding layer; 257 is a :shape error" do
    {q, k, v, d_out} = inputs({:f, 32}, {1, 16, 16, 2, 2, 12}, 200)
    {:ok, o, lse} = FA.forward_with_states(q, k, v, device: :cpu)
    {:ok, dq, dk, dv} = FA.backward(d_out, q, k, v, o, lse, device: :cpu)

    task = Task.async(fn -> FA.forward_with_states(q, k, v, device: :cuda) end)
    assert {:ok, go, glse} = Task.await(task)
    assert Numeric.rel_err(go, o) <= 1.0e-5 and Numeric.rel_err(glse, lse) <= 1.0e-5
    task = Task.async(fn -> FA.backward(d_out, q, k, v, o, lse, device: :cuda) end)
    assert {:ok, gdq, gdk, gdv} = Task.await(task)
    for {g, c} <- [{gdq, dq}, {gdk, dk}, {gdv, dv}], do: assert(Numeric.rel_err(g, c) <= 1.0e-5)

    {q, k, v, _} = inputs({:f, 32}, {1, 4, 4, 1, 1, 257}, 201)
    assert {:error, {:shape, msg}} = FA.forward(q, k, v, device: :cuda)
    assert msg =~ "between 1 and 256"

    assert_raise ExPhil.Native.FlashAttention.Error, ~r/\(shape\)/, fn ->
      FA.forward!(q, k, v, device: :cuda)
    end
  end

  test "edge sizes on :cuda: no keys, no batch, one query" do
    q = Numeric.random({1, 2, 2, 8}, {:f, 32}, 1)
    none = %Tensor{data: <<>>, shape: {1, 0, 2, 8}, type: {:f, 32}}

    assert FA.forward_with_states(q, none, none, causal: false, device: :cuda) ==
             FA.forward_with_states(q, none, none, causal: false, device: :cpu)

    empty = %Tensor{data: <<>>, shape: {0, 2, 2, 8}, type: {:f, 32}}
    assert {:ok, %Tensor{data: <<>>, shape: {0, 2, 2, 8}}} = FA.forward(empty, empty, empty, device: :cuda)

    {q1, k1, v1, _} = inputs({:bf, 16}, {1, 1, 300, 8, 2, 64}, 300)
    {:ok, o_gpu} = FA.forward(q1, k1, v1, device: :cuda)
    {:ok, o_ref} = FA.forward(up(q1), up(k1), up(v1), device: :cpu)
    assert Numeric.rel_err(o_gpu, o_ref) <= tol({:bf, 16}, o_ref)
  end

  test "many processes at once on :cuda each get their own answer" do
    jobs =
      for i <- 1..16 do
        type = Enum.at(@types, rem(i, 3))
        # odd sizes and head_dim 64: the kernels the cases above compiled
        {inputs(type, {1, 17 + 2 * i, 33 + 2 * i, 4, 2, 64}, 1000 + i), [causal: rem(i, 2) == 0]}
      end

    call = fn {{q, k, v, d_out}, opts} ->
      opts = [{:device, :cuda} | opts]
      {:ok, o, lse} = FA.forward_with_states(q, k, v, opts)
      {:ok, dq, dk, dv} = FA.backward(d_out, q, k, v, o, lse, opts)
      {o, lse, dq, dk, dv}
    end

    expected = Enum.map(jobs, call)

    got =
      jobs
      |> Task.async_stream(fn job -> for(_ <- 1..3, do: call.(job)) end, max_concurrency: 16, timeout: 300_000)
      |> Enum.map(fn {:ok, rs} -> rs end)

    # The forward bit for bit; the backward within 1e-5 (f32) / 2e-3 (16-bit) of the lone call,
    # far below what another call's buffers or options would give.
    for {{o, lse, _, _, _} = want, rs} <- Enum.zip(expected, got), r <- rs do
      assert {elem(r, 0), elem(r, 1)} == {o, lse}

      for i <- 2..4 do
        limit = if elem(want, i).type == {:f, 32}, do: 1.0e-5, else: 2.0e-3
        assert Numeric.rel_err(elem(r, i), elem(want, i)) <= limit
      end
    end
  end

  test "timing: one NIF call, host binaries in and out (printed, not asserted)" do
    # B=1, S=2048, H=8, Hkv=2, D=64, causal: includes the host<->GPU copies and the BEAM's
    # binary handling; the first :cuda call also compiles (or loads from the disk cache) kernels.
    shape = {1, 2048, 2048, 8, 2, 64}

    lines =
      for type <- [{:bf, 16}, {:f, 32}] do
        {q, k, v, d_out} = inputs(type, shape, 400)

        times = fn device, n ->
          for _ <- 1..n do
            {t_f, {:ok, o, lse}} = :timer.tc(fn -> FA.forward_with_states(q, k, v, device: device) end)
            {t_b, {:ok, _, _, _}} = :timer.tc(fn -> FA.backward(d_out, q, k, v, o, lse, device: device) end)
            {t_f / 1000, t_b / 1000}
          end
        end

        [{first_f, first_b} | _] = times.(:cuda, 1)
        gpu = times.(:cuda, 7)
        cpu = times.(:cpu, 3)

        "  #{label(type)}: cuda forward #{ms(median(gpu, 0))} backward #{ms(median(gpu, 1))} " <>
          "(first call #{ms(first_f)} / #{ms(first_b)}); cpu (#{System.schedulers_online()} schedulers) " <>
          "forward #{ms(median(cpu, 0))} backward #{ms(median(cpu, 1))}"
      end

    IO.puts("\nNIF call times, b1 s2048 h8/2 d64 causal, median (ms):\n" <> Enum.join(lines, "\n"))
  end

  ## Running a case

  defp inputs(type, {b, sq, sk, h, hkv, d}, seed) do
    {Numeric.random({b, sq, h, d}, type, seed), Numeric.random({b, sk, hkv, d}, type, seed + 1),
     Numeric.random({b, sk, hkv, d}, type, seed + 2), Numeric.random({b, sq, h, d}, type, seed + 3)}
  end

  # {:ok, %{errors: %{out => %{cuda:, cpu:, tol:, max_abs:}}, deterministic:}} or {:error, reason}.
  defp run_case(type, shape, opts) do
    {q, k, v, d_out} = inputs(type, shape, :erlang.phash2({type, shape, opts}, 10_000))
    gpu = [{:device, :cuda} | opts]
    cpu = [{:device, :cpu} | opts]

    with {:ok, o, lse} <- FA.forward_with_states(q, k, v, gpu),
         {:ok, dq, dk, dv} <- FA.backward(d_out, q, k, v, o, lse, gpu),
         {:ok, o2, lse2} <- FA.forward_with_states(q, k, v, gpu),
         {:ok, dq2, dk2, dv2} <- FA.backward(d_out, q, k, v, o, lse, gpu) do
      # The reference: the CPU in f32 on the same values; its backward gets the GPU's o and lse.
      {:ok, ro, rlse} = FA.forward_with_states(up(q), up(k), up(v), cpu)
      {:ok, rdq, rdk, rdv} = FA.backward(up(d_out), up(q), up(k), up(v), up(o), lse, cpu)
      # The CPU backend in the same storage type, for comparison.
      {:ok, co, clse} = FA.forward_with_states(q, k, v, cpu)
      {:ok, cdq, cdk, cdv} = FA.backward(d_out, q, k, v, co, clse, cpu)

      triples = [
        o: {o, ro, co},
        lse: {lse, rlse, clse},
        dq: {dq, rdq, cdq},
        dk: {dk, rdk, cdk},
        dv: {dv, rdv, cdv}
      ]

      errors =
        Map.new(triples, fn {out, {g, r, c}} ->
          {out,
           %{
             cuda: Numeric.rel_err(g, r),
             cpu: Numeric.rel_err(c, r),
             tol: tol(g.type, r),
             max_abs: max_abs(g, c)
           }}
        end)

      {:ok,
       %{
         errors: errors,
         type: type,
         forward_repeats: {o, lse} == {o2, lse2},
         backward_repeats: {dq, dk, dv} == {dq2, dk2, dv2},
         second_backward: [
           dq: Numeric.rel_err(dq2, rdq),
           dk: Numeric.rel_err(dk2, rdk),
           dv: Numeric.rel_err(dv2, rdv)
         ]
       }}
    end
  end

  # The oracle fixtures on the GPU: {:ok, [out: rel_err, ...]} (as oracle_fixtures_test.exs) or the error.
  defp run_fixture(c) do
    t = c.tensors
    opts = [{:device, :cuda} | c.opts]

    # dsinks too with sinks (Fixtures.gradients/1)
    with {:ok, o, lse} <- Fixtures.forward(c, opts),
         {:ok, grads} <- c |> Fixtures.backward(t.o_in, t.lse_in, opts) |> Fixtures.gradients(),
         {:ok, grads_own} <- c |> Fixtures.backward(o, lse, opts) |> Fixtures.gradients() do
      {:ok, Fixtures.errors(t, {o, lse}, grads, grads_own)}
    end
  end

  ## Numbers

  defp up(%Tensor{type: {:f, 32}} = t), do: t
  defp up(%Tensor{} = t), do: Tensor.from_list(Tensor.to_list(t), t.shape, {:f, 32})

  # tests/conftest.py's tolerance for an output stored in `type`, against the f32 reference.
  defp tol({:f, 32}, _ref), do: 1.0e-5

  defp tol(type, %Tensor{} = ref),
    do: 2 * Numeric.rel_err(Tensor.from_list(Tensor.to_list(ref), ref.shape, type), ref) + 1.0e-5

  # Largest |a - b| over finite pairs; :infinity where the non-finite entries differ.
  defp max_abs(%Tensor{} = a, %Tensor{} = b) do
    Enum.zip(Tensor.to_list(a), Tensor.to_list(b))
    |> Enum.reduce(0.0, fn
      _, :infinity -> :infinity
      {x, y}, m when is_float(x) and is_float(y) -> max(m, abs(x - y))
      {x, x}, m -> m
      _, _ -> :infinity
    end)
  end

  defp median(pairs, i) do
    sorted = pairs |> Enum.map(&elem(&1, i)) |> Enum.sort()
    Enum.at(sorted, div(length(sorted), 2))
  end

  defp ms(x), do: :erlang.float_to_binary(x * 1.0, decimals: 2)

  defp fmt(x) when is_float(x), do: :erlang.float_to_binary(x, [{:scientific, 2}])
  defp fmt(x), do: inspect(x)

  defp report(results, fixtures) do
    lines =
      for {name, _, _, _} <- @cases do
        case results[name] do
          {:ok, r} ->
            cells = Enum.map_join(@outputs, " ", fn out -> "#{out}=#{fmt(r.errors[out].cuda)}" end)
            cpu = Enum.map_join(@outputs, " ", fn out -> fmt(r.errors[out].cpu) end)
            gap = @outputs |> Enum.map(&r.errors[&1].max_abs) |> Enum.max()
            bits = if r.backward_repeats, do: "", else: " (backward bits vary run to run)"
            "  #{String.pad_trailing(name, 40)} cuda #{cells} | cpu #{cpu} | max|cuda-cpu| #{fmt(gap)}#{bits}"

          error ->
            "  #{String.pad_trailing(name, 40)} #{inspect(error)}"
        end
      end

    worst =
      for type <- @types do
        oks = for {_, {:ok, %{type: ^type} = r}} <- results, do: r
        cuda = for r <- oks, out <- @outputs, do: r.errors[out].cuda
        cpu = for r <- oks, out <- @outputs, do: r.errors[out].cpu
        gap = for r <- oks, out <- @outputs, do: r.errors[out].max_abs

        ratio =
          for r <- oks,
              out <- @outputs,
              type != {:f, 32},
              out != :lse,
              do: r.errors[out].cuda / ((r.errors[out].tol - 1.0e-5) / 2)

        max = fn xs -> fmt(Enum.max(xs, fn -> 0.0 end)) end

        "  #{label(type)}: cuda #{max.(cuda)}, cpu #{max.(cpu)}, max|cuda-cpu| #{max.(gap)}" <>
          if(ratio == [], do: "", else: ", worst error / rounding baseline #{max.(ratio)} (bound 2)")
      end

    fixture_lines =
      for c <- Fixtures.cases() do
        case fixtures[c.name] do
          {:ok, errs} ->
            "  #{String.pad_trailing(c.name, 33)} " <>
              Enum.map_join(errs, " ", fn {k, e} -> "#{k}=#{fmt(e)}" end)

          other ->
            "  #{String.pad_trailing(c.name, 33)} #{inspect(other, printable_limit: 100)}"
        end
      end

    IO.puts(
      "\n:cuda vs the f32 CPU reference (relative error; tolerances f32 1e-5, f16/bf16 2x rounding + 1e-5):\n" <>
        Enum.join(lines, "\n") <>
        "\n  worst per type:\n" <>
        Enum.join(worst, "\n") <>
        "\n:cuda vs the float64 oracle fixtures:\n" <> Enum.join(fixture_lines, "\n")
    )
  end
end
