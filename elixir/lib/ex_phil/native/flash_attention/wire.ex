defmodule ExPhil.Native.FlashAttention.Wire do
  @moduledoc false
  # Tensors across the NIF boundary and the plumbing every public function shares: an argument as
  # the NIF's {data, [dims], dtype_name}, a NIF output {data, shape} back in the caller's form
  # (Tensor struct or Nx tensor), the loaded check, and the raising unwrap of the ! variants.
  #
  # Nx is optional and never a compile-time dependency: an Nx.Tensor is recognised by its struct
  # name and converted through Nx's public functions, which exist whenever one was built.
  # (mix.exs's `xref: [exclude: [Nx]]` keeps the compiler quiet with Nx and without it.)

  alias ExPhil.Native.FlashAttention.{Error, Nif, Tensor}

  def unwrap!({:ok, one}), do: one
  def unwrap!({:ok, a, b}), do: {a, b}
  def unwrap!({:ok, a, b, c}), do: {a, b, c}
  def unwrap!({:ok, a, b, c, d}), do: {a, b, c, d}
  def unwrap!({:error, {kind, message}}), do: raise(Error, kind: kind, message: message)

  def loaded do
    case Nif.status() do
      :ok -> :ok
      {:error, message} -> {:error, {:nif_not_loaded, message}}
    end
  end

  # Each named argument as the NIF's {data, [dims], dtype_name}, or the first problem found.
  def wire(named) do
    Enum.reduce_while(named, {:ok, []}, fn {name, t}, {:ok, acc} ->
      case wire(t, name) do
        {:ok, w} -> {:cont, {:ok, [w | acc]}}
        error -> {:halt, error}
      end
    end)
    |> case do
      {:ok, acc} -> {:ok, Enum.reverse(acc)}
      error -> error
    end
  end

  def wire(%Tensor{data: data, shape: shape, type: type}, name) when is_binary(data) do
    if shape?(shape) do
      {:ok, {data, Tuple.to_list(shape), type_name(type)}}
    else
      {:error,
       {:shape, "#{name} has shape #{inspect(shape)}; a shape must be a tuple of non-negative integers"}}
    end
  end

  def wire(%Tensor{data: data}, name),
    do: {:error, {:argument, "#{name}.data must be a binary, got: #{short(data)}"}}

  # Nx.to_binary/1 would give every entry's data and Nx.shape/1 one entry's shape: refuse instead.
  def wire(%{__struct__: Nx.Tensor, vectorized_axes: [_ | _] = axes}, name) do
    {:error,
     {:argument,
      "#{name} is a vectorized Nx tensor (vectorized axes #{inspect(axes)}), which is not " <>
        "supported; devectorize it first (Nx.devectorize/2) and fold those axes into the batch axis"}}
  end

  def wire(%{__struct__: Nx.Tensor} = t, name) do
    if Code.ensure_loaded?(Nx) do
      try do
        %Tensor{data: Nx.to_binary(t), shape: Nx.shape(t), type: Nx.type(t)}
      rescue
        e -> {:error, {:argument, "cannot read #{name} with Nx.to_binary/1: #{Exception.message(e)}"}}
      else
        host -> wire(host, name)
      end
    else
      {:error, {:argument, "#{name} is an Nx.Tensor but the Nx module is not available"}}
    end
  end

  def wire(other, name) do
    {:error,
     {:argument,
      "#{name} must be an ExPhil.Native.FlashAttention.Tensor or an Nx.Tensor, got: #{short(other)}"}}
  end

  def shape?(shape) when is_tuple(shape),
    do: shape |> Tuple.to_list() |> Enum.all?(&(is_integer(&1) and &1 >= 0))

  def shape?(_), do: false

  # The core parses these names; any other type reaches it as its inspect() and is rejected there
  # with a :dtype error naming the accepted types.
  def type_name({:f, 32}), do: "float32"
  def type_name({:f, 16}), do: "float16"
  def type_name({:bf, 16}), do: "bfloat16"
  def type_name({:s, 32}), do: "int32"
  def type_name({:u, 8}), do: "uint8"
  def type_name({:u, 32}), do: "uint32"
  def type_name(other), do: inspect(other)

  def type_of(%Tensor{type: type}), do: type
  def type_of(%{__struct__: Nx.Tensor} = t), do: Nx.type(t)

  # A NIF output {data, shape} in the form of q: an Nx tensor when q is one, else a Tensor struct.
  def result(%{__struct__: Nx.Tensor}, {data, shape}, type),
    do: data |> Nx.from_binary(type) |> Nx.reshape(shape)

  def result(_q, {data, shape}, type), do: %Tensor{data: data, shape: shape, type: type}

  def short(term), do: inspect(term, limit: 5, printable_limit: 40)

  def unsupported(message), do: {:error, {:unsupported, message}}
end
