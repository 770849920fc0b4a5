//! What a NIF call returns: `{:ok, term...}` or `{:error, {kind, message}}`, never a raise, and
//! never an unwinding panic (a panic becomes `{:error, {:internal, message}}`).

use flash_core::FlashError;
use rustler::types::tuple::make_tuple;
use rustler::{Atom, Encoder, Env, Term};
use std::panic::{catch_unwind, AssertUnwindSafe};

rustler::atoms! {
    ok,
    error,
}

/// Why a call failed: `kind` becomes the atom of `{:error, {kind, message}}`.
#[derive(Debug)]
pub struct Reason {
    kind: &'static str,
    message: String,
}

impl Reason {
    /// A term that is not what the Elixir wrapper sends (the wrapper checks first, so this
    /// only happens when the stubs module is called directly).
    pub fn argument(message: String) -> Reason {
        Reason {
            kind: "argument",
            message,
        }
    }

    fn encode<'a>(&self, env: Env<'a>) -> Term<'a> {
        // The kinds are a fixed set of short snake_case names, so the atom always exists or fits.
        let kind =
            Atom::from_str(env, self.kind).map_or_else(|_| error().encode(env), |a| a.encode(env));
        (error(), (kind, self.message.as_str())).encode(env)
    }
}

impl From<FlashError> for Reason {
    fn from(e: FlashError) -> Reason {
        Reason {
            kind: e.kind(),
            message: e.to_string(),
        }
    }
}

/// Runs a NIF body: `Ok(terms)` becomes `{:ok, terms...}`, `Err(reason)` becomes
/// `{:error, {kind, message}}`, and a panic becomes `{:error, {:internal, message}}`.
pub fn guard<'a>(env: Env<'a>, body: impl FnOnce() -> Result<Vec<Term<'a>>, Reason>) -> Term<'a> {
    let result = catch_unwind(AssertUnwindSafe(body)).unwrap_or_else(|payload| {
        let what = payload
            .downcast_ref::<&str>()
            .map(|s| s.to_string())
            .or_else(|| payload.downcast_ref::<String>().cloned())
            .unwrap_or_else(|| "a non-string panic payload".into());
        Err(Reason::from(FlashError::Internal(format!(
            "panic in the flash_nif NIF: {what}"
        ))))
    });
    match result {
        Ok(terms) => {
            let mut all = Vec::with_capacity(terms.len() + 1);
            all.push(ok().encode(env));
            all.extend(terms);
            make_tuple(env, &all)
        }
        Err(reason) => reason.encode(env),
    }
}
