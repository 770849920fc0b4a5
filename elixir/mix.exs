# ExPhil.Native.FlashAttention: exact FlashAttention forward/backward for Elixir, through a
# Rustler NIF over the flash-core crate in this repository. No hex packages: `mix compile`
# builds the crate with cargo and copies the library into priv/, and the module loads it with
# :erlang.load_nif/2.

defmodule Mix.Tasks.Compile.FlashNif do
  @moduledoc """
  Builds `native/flash-nif` with `cargo build --release -p flash-nif` (run from the repository
  root, honouring `CARGO_TARGET_DIR`) and copies the library to `priv/libflash_nif.so`.

  Cargo decides what is out of date, so this runs on every `mix compile` and costs a fraction of
  a second when nothing changed. Set `FLASH_NIF_SKIP_BUILD=1` to use the library already in
  `priv/` without calling cargo (e.g. a prebuilt one).
  """
  use Mix.Task.Compiler

  @crate "flash-nif"
  @lib "flash_nif"

  @impl true
  def run(_args) do
    root = Path.expand("..", __DIR__)
    dest = Path.join([__DIR__, "priv", "lib#{@lib}.so"])

    cond do
      System.get_env("FLASH_NIF_SKIP_BUILD") in ["1", "true"] ->
        if File.exists?(dest) do
          {:noop, []}
        else
          error("FLASH_NIF_SKIP_BUILD is set but #{dest} does not exist")
        end

      cargo = cargo_executable() ->
        with {status, diagnostics} when status in [:ok, :noop] <- build(cargo, root, dest) do
          link_priv()
          {status, diagnostics}
        end

      File.exists?(dest) ->
        Mix.shell().info("flash_nif: cargo not found; using the existing #{dest} as is")
        {:noop, []}

      true ->
        error(
          "cargo was not found (looked in PATH and ~/.cargo/bin). Install Rust " <>
            "(https://rustup.rs) to build the flash_nif NIF, or set FLASH_NIF_SKIP_BUILD=1 " <>
            "with a prebuilt library at #{dest}"
        )
    end
  end

  defp build(cargo, root, dest) do
    args = ["build", "--release", "-p", @crate]
    Mix.shell().info("flash_nif: cargo #{Enum.join(args, " ")} (in #{root})")

    case System.cmd(cargo, args, cd: root, into: IO.stream(:stdio, :line), stderr_to_stdout: true) do
      {_, 0} -> install(artifact(root), dest)
      {_, status} -> error("cargo build failed with exit status #{status}; see its output above")
    end
  end

  # cargo names the library after the target OS; the BEAM wants `.so` everywhere but Windows.
  defp artifact(root) do
    target = System.get_env("CARGO_TARGET_DIR") || "target"
    dir = Path.expand(Path.join(target, "release"), root)

    case :os.type() do
      {:unix, :darwin} -> Path.join(dir, "lib#{@lib}.dylib")
      {:win32, _} -> Path.join(dir, "#{@lib}.dll")
      _ -> Path.join(dir, "lib#{@lib}.so")
    end
  end

  defp install(src, dest) do
    with {:ok, new} <- File.read(src) do
      if File.read(dest) == {:ok, new} do
        {:noop, []}
      else
        File.mkdir_p!(Path.dirname(dest))
        # Write beside and rename, so a running VM that mapped the old file keeps a valid one.
        tmp = dest <> ".tmp"
        File.write!(tmp, new)
        File.rename!(tmp, dest)
        Mix.shell().info("flash_nif: installed #{dest}")
        {:ok, []}
      end
    else
      {:error, reason} -> error("cannot read the built library #{src}: #{:file.format_error(reason)}")
    end
  end

  # Mix links priv/ into _build before the compilers run, and only if priv/ existed then; on a
  # first build without priv/ (it holds only the library, which git ignores) link it now.
  defp link_priv do
    unless File.exists?(Path.join(Mix.Project.app_path(), "priv")), do: Mix.Project.build_structure()
  end

  defp cargo_executable do
    System.find_executable("cargo") ||
      Enum.find([Path.expand("~/.cargo/bin/cargo")], &File.exists?/1)
  end

  defp error(message) do
    Mix.shell().error("flash_nif: " <> message)
    {:error, [diagnostic(message)]}
  end

  defp diagnostic(message) do
    %Mix.Task.Compiler.Diagnostic{
      compiler_name: "flash_nif",
      file: Path.expand("mix.exs", __DIR__),
      message: message,
      position: nil,
      severity: :error
    }
  end
end

defmodule FlashNif.MixProject do
  use Mix.Project

  def project do
    [
      app: :flash_nif,
      version: cargo_version(),
      elixir: "~> 1.14",
      compilers: [:flash_nif] ++ Mix.compilers(),
      elixirc_paths: elixirc_paths(Mix.env()),
      start_permanent: Mix.env() == :prod,
      deps: [],
      # Nx is optional (used only when the caller passes Nx tensors): without this, compiling
      # beside an application that has Nx warns that :nx is not among our dependencies.
      xref: [exclude: [Nx]],
      description: "Exact FlashAttention forward/backward for Elixir (Rustler NIF over flash-core)"
    ]
  end

  def application do
    [extra_applications: [:logger]]
  end

  defp elixirc_paths(:test), do: ["lib", "test/support"]
  defp elixirc_paths(_), do: ["lib"]

  # One version for the Rust workspace and this project; the NIF reports its own at load time.
  defp cargo_version do
    manifest = Path.expand("../Cargo.toml", __DIR__)

    with {:ok, text} <- File.read(manifest),
         [_, version] <- Regex.run(~r/\[workspace\.package\][^\[]*?\bversion\s*=\s*"([^"]+)"/s, text) do
      version
    else
      _ -> Mix.raise("cannot read [workspace.package] version from #{manifest}")
    end
  end
end
