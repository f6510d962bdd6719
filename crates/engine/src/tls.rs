//! TLS for `amqps://` and `rediss://` (rustls), shared by the broker and the Redis connections.

/// Install aws-lc-rs as the process's rustls crypto provider, unless one is installed already.
///
/// lapin (`amqps://`), redis (`rediss://`) and kube all use rustls; with more than one provider
/// compiled in, rustls panics at the first TLS connection unless a process default exists. The
/// binary calls this first thing; the connect functions call it too, for library users.
pub fn install_provider() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        if rustls::crypto::CryptoProvider::get_default().is_none() {
            // An error means another thread installed one in the meantime: as good.
            let _ = rustls::crypto::aws_lc_rs::default_provider().install_default();
        }
    });
}

/// A connection error message, with what to do when the server's TLS certificate was not
/// trusted (rustls says `invalid peer certificate: UnknownIssuer` and the like).
pub fn hint(message: String) -> String {
    let lower = message.to_lowercase();
    if lower.contains("certificate") {
        format!(
            "{message} (TLS: the server's certificate was not accepted; a private CA must be in the PEM file SSL_CERT_FILE names, or in the system store, and the URL's host must be a name or address the certificate is issued for)"
        )
    } else {
        message
    }
}
