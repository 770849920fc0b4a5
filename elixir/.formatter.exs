[
  inputs: ["{mix,.formatter}.exs", "{lib,test,examples,bench}/**/*.{ex,exs}"],
  line_length: 110
]
