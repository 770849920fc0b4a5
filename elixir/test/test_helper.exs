# The scheduler test starts a second VM and takes a few seconds; `mix test --exclude slow` skips it.
ExUnit.start()
