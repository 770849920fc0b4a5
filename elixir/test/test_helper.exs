# The scheduler test starts a second VM and takes a few seconds; `mix test --exclude slow` skips it.
#
# The :cuda tests (test/cuda_test.exs) run the GPU backend. FLASH_NIF_TEST_CUDA=1 requires them
# (they fail without a usable GPU), FLASH_NIF_TEST_CUDA=0 excludes them, and otherwise they run
# exactly when the NIF reports a usable GPU (cuda_available?/0: info/0 lists :cuda), so a machine
# without one skips them. `mix test --only cuda` runs them alone.
cuda? =
  case System.get_env("FLASH_NIF_TEST_CUDA") do
    "1" ->
      true

    "0" ->
      false

    _ ->
      ExPhil.Native.FlashAttention.cuda_available?()
  end

ExUnit.start(exclude: if(cuda?, do: [], else: [:cuda]))
