//! The replay's URLs from its Secrets; no password ever leaves this module in an error.

use k8s_openapi::api::core::v1::Secret;
use kube::api::Api;
use kube::{Client, ResourceExt};

use crate::api::{ConnectionSpec, DlqReplay};
use crate::engine::Replay;

/// Resolve the Secret references of a replay into URLs; the error says which is missing.
pub async fn resolve(client: &Client, obj: &DlqReplay) -> Result<Replay, String> {
    let ns = obj.namespace_or_default();
    let spec = &obj.spec;
    let amqp_url = url_of(client, &ns, &spec.broker, "spec.broker").await?;
    let redis = spec
        .idempotency
        .as_ref()
        .and_then(|i| i.redis.as_ref().map(|r| (r, "spec.idempotency.redis")))
        .or_else(|| {
            spec.audit
                .as_ref()
                .and_then(|a| a.redis.as_ref().map(|r| (r, "spec.audit.redis")))
        })
        .ok_or_else(|| "NoRedis: set spec.idempotency.redis or spec.audit.redis".to_string())?;
    let redis_url = url_of(client, &ns, redis.0, redis.1).await?;
    Ok(Replay {
        namespace: ns,
        name: obj.name_any(),
        spec: spec.0.clone(),
        amqp_url,
        redis_url,
        uid: obj.uid(),
    })
}

async fn url_of(
    client: &Client,
    ns: &str,
    c: &ConnectionSpec,
    path: &str,
) -> Result<String, String> {
    if let Some(u) = &c.url {
        return Ok(u.clone());
    }
    let Some(r) = &c.url_secret_ref else {
        return Err(format!("NoUrl: {path} has neither url nor urlSecretRef"));
    };
    let secrets: Api<Secret> = Api::namespaced(client.clone(), ns);
    let secret = secrets
        .get_opt(&r.name)
        .await
        .map_err(|e| {
            format!(
                "SecretUnreadable: Secret {ns}/{} ({path}.urlSecretRef): {e}",
                r.name
            )
        })?
        .ok_or_else(|| {
            format!(
                "SecretMissing: Secret {ns}/{} ({path}.urlSecretRef) does not exist",
                r.name
            )
        })?;
    let value = secret
        .data
        .as_ref()
        .and_then(|d| d.get(&r.key))
        .map(|b| String::from_utf8_lossy(&b.0).trim().to_string())
        .or_else(|| {
            secret
                .string_data
                .as_ref()
                .and_then(|d| d.get(&r.key).cloned())
        })
        .ok_or_else(|| {
            format!(
                "SecretKeyMissing: Secret {ns}/{} has no key {:?} ({path}.urlSecretRef)",
                r.name, r.key
            )
        })?;
    Ok(value)
}
